"""One benchmark row, in a process of its own: every mode gets the same fresh machine state.

``python -m saguaro.bench.worker PARAMS_JSON MODE BACKEND OUT_JSON`` loads the pair, compiles what the
row needs, warms up every batch of prompts (each shape bucket compiled and warm), times them all, and
writes the row to ``OUT_JSON``. :func:`run_one` is the same in the caller's process.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from saguaro.bench.prompts import PromptSet, prompt_set
from saguaro.bench.rows import DRAFT_MODES, SAGUARO_MODES, compile_for, time_row


@dataclass(frozen=True)
class BenchParams:
    """What one benchmark run measures. ``modes=None``: every row that applies."""

    target: str | None = None  # a save_pretrained folder; None with draft None: the default pair
    draft: str | None = None
    modes: tuple | None = None
    prompts: int = 8
    batch: int = 1
    k: int = 5
    max_new_tokens: int = 64
    temperature: float = 0.0
    backend: str = "inductor"  # "eager", "inductor" or "both"
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    threads: int | None = None
    same_process: bool = False  # every row in the caller's process instead of one process each
    trace_dir: str | None = None  # write one timeline per Saguaro row here
    plan: str = "auto"  # "always-ssd": sd_when_faster=False, SSD's own rounds on any machine


def run_prompts(params: BenchParams, tokenizer, target) -> PromptSet:
    """The run's prompts: held-out text for the default pair (no folders given), each short enough to
    leave ``max_new_tokens`` positions; every row's process builds the same ones (deterministic)."""
    default_pair = params.target is None and params.draft is None
    positions = getattr(target.config, "max_position_embeddings", None)
    room = positions - params.max_new_tokens if positions else None
    return prompt_set(tokenizer, params.prompts, target.config.vocab_size, params.seed, default_pair, room)


def run_one(params: BenchParams, mode: str, backend: str) -> dict:
    """Load the pair, compile for ``backend`` if the row is Saguaro's, warm up and time ``mode``."""
    from saguaro.models_io import DTYPES, load_pair

    if params.threads is not None:
        torch.set_num_threads(params.threads)
    need_draft = mode in DRAFT_MODES
    target, draft, tokenizer = load_pair(params.target, params.draft, need_draft=need_draft,
                                         dtype=DTYPES[params.dtype], device=params.device)
    draft = draft if need_draft else None
    prompts = run_prompts(params, tokenizer, target)
    program, compile_s = None, None
    started = time.perf_counter()
    if mode in SAGUARO_MODES:
        program = compile_for(target, draft, params.k, backend, sd_when_faster=params.plan != "always-ssd")
    try:
        row = time_row(target, draft, program, prompts.ids, mode, params.k, params.max_new_tokens, params.temperature,
                       params.batch, params.seed, trace_dir=params.trace_dir, backend=backend)
    finally:
        if program is not None:
            program.close()
    if mode in SAGUARO_MODES:
        row["backend"] = backend
        compile_s = time.perf_counter() - started - row["wall_s"]  # capture, compile and the warm-up pass
    ssd = mode.startswith("ssd") and torch.device(params.device).type == "cpu"
    threads = torch.get_num_threads()
    row["threads"] = {"target": 1, "draft": 1} if ssd else {"target": threads, "draft": threads}
    row["setup_s"] = compile_s
    row["prompt_source"] = prompts.source
    return row


def main(argv=None) -> int:
    params_json, mode, backend, out = argv if argv is not None else sys.argv[1:]
    fields = json.loads(params_json)
    fields["modes"] = tuple(fields["modes"]) if fields.get("modes") else None
    row = run_one(BenchParams(**fields), mode, backend)
    path = Path(out)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(row))
    tmp.replace(path)
    return 0


def params_json(params: BenchParams) -> str:
    return json.dumps(asdict(params))


if __name__ == "__main__":
    sys.exit(main())
