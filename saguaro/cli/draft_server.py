"""``saguaro draft-server``: serve a draft model to one target at a time over ``torch.distributed``
(``saguaro.compile(target, draft_address="HOST:PORT", lane="remote")`` connects to it).

It binds only the address given (loopback without a host), prints it and a ready line, and serves until
interrupted (:mod:`saguaro.cli.stop_watchdog`). A non-loopback address needs a shared secret
(``--secret-file`` or ``SAGUARO_DRAFT_SECRET``), else it refuses to start.
"""

from __future__ import annotations

import sys

from saguaro.cli.args import int_at_least
from saguaro.cli.registry import Subcommand
from saguaro.cli.stop_watchdog import StopWatchdog


def add_arguments(parser) -> None:
    parser.add_argument(
        "--listen",
        required=True,
        metavar="HOST:PORT",
        help="address to listen on (HOST omitted: 127.0.0.1); only this address is bound",
    )
    parser.add_argument(
        "--draft", metavar="DIR", help="saved draft model folder (default: the default pair's draft)"
    )
    parser.add_argument(
        "--device", default="cpu", help="where the draft runs: cpu, cuda, cuda:1, ... (default cpu)"
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="weights dtype (default float32; the target must use the same)",
    )
    parser.add_argument(
        "--threads",
        type=int_at_least(1, "threads"),
        default=None,
        help="intra-op CPU threads of the draft (default: torch's)",
    )
    parser.add_argument(
        "--secret-file",
        metavar="PATH",
        default=None,
        help="file holding the secret shared with the targets (default: $SAGUARO_DRAFT_SECRET); "
        "required for a non-loopback address",
    )


class DraftRunners:
    """The draft captured once; one runner per (backend, attention, CUDA graphs) the targets ask for."""

    def __init__(self, model):
        from saguaro.compile import build_runner
        from saguaro.core.config import SaguaroConfig

        self.base = build_runner("draft", model, SaguaroConfig(backend="eager"))
        self.runners = {("eager", "auto", False, True): self.base}

    def server(self, config):
        from saguaro.compile import CompiledStages
        from saguaro.lower.cuda_graphs import resolve_cuda_graphs
        from saguaro.runtime.base.kv_store import KVPool
        from saguaro.runtime.base.model_runner import ModelRunner
        from saguaro.runtime.draft.server import SpeculationServer

        captured = self.base.captured
        graphs = resolve_cuda_graphs(config.cuda_graphs, captured.spec.device)
        key = (config.backend, config.attention, graphs, config.narrow_weights)
        if key not in self.runners:
            builder = CompiledStages(
                "draft",
                captured.graph_module,
                self.base.width,
                config.backend,
                config.attention,
                captured.spec.device.type,
                graphs,
                narrow_weights=config.narrow_weights,
            )
            self.runners[key] = ModelRunner(
                "draft", captured, builder, self.base.width, kv_pool=KVPool() if graphs else None
            )
        return SpeculationServer(self.runners[key], config)


def load_draft(folder: str | None, dtype, device):
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from saguaro.core.errors import SaguaroError
    from saguaro.default_pair import ASSETS_DIR

    folder = folder or str(ASSETS_DIR / "draft")
    if not Path(folder, "config.json").is_file():
        raise ValueError(
            f"--draft {folder!r} is not a folder holding a saved Hugging Face model (no config.json)"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    except Exception as exc:
        raise SaguaroError(f"could not load the draft from {folder!r}: {exc}") from exc
    return model if device is None else model.to(device)


def run(args) -> int:
    import os

    import torch

    from saguaro.models_io import DTYPES, check_device
    from saguaro.runtime.lanes.remote_handshake import parse_address, read_secret
    from saguaro.runtime.lanes.remote_server import DraftServer, check_listen

    host, port = parse_address(args.listen)
    secret = read_secret(args.secret_file)
    check_listen(host, secret)  # before the model is loaded: a refusal costs nothing
    device = check_device(args.device) or torch.device("cpu")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = load_draft(args.draft, DTYPES[args.dtype], device)
    runners = DraftRunners(model)
    spec = runners.base.spec
    draft = {
        "vocab_size": spec.vocab_size,
        "dtype": str(spec.dtype).removeprefix("torch."),
        "max_positions": spec.max_positions,
        "width": runners.base.width,
        "device_type": device.type,
        "model_class": type(model).__name__,
        "pid": os.getpid(),
    }
    server = DraftServer(host, port, secret, runners.server, draft, device)
    sys.stdout.write(
        f"saguaro draft-server listening on {server.address} ({type(model).__name__}, "
        f"{spec.vocab_size} tokens, {draft['dtype']}, {device}; secret: {'yes' if secret else 'no'})\n"
    )
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    try:
        with StopWatchdog("saguaro draft-server"):
            server.serve()
    except KeyboardInterrupt:
        sys.stdout.write("saguaro draft-server: stopped\n")
    return 0


COMMAND = Subcommand(
    "draft-server", "serve a draft model to a target on another machine (lane='remote')", add_arguments, run
)
