"""The command line's argument types and shared options: each rejects a bad value with a message naming
it and what is allowed, before any model is loaded."""

from __future__ import annotations

import argparse
import math

from saguaro.bench.rows import ALL_MODES
from saguaro.core.config import MAX_K


def int_at_least(low: int, name: str, high: int | None = None):
    """An argparse ``type`` accepting ints in ``low..high``; the error names the value and the range."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an int") from None
        if value < low or (high is not None and value > high):
            allowed = f"{low}..{high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"{name}={value} is not allowed: it must be an int {allowed}")
        return value

    return parse


def temperature_arg(text: str) -> float:
    """An argparse ``type``: a finite float >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(
            f"temperature={text} is not allowed: it must be a finite number >= 0"
        )
    return value


def add_model_args(parser, backends=("eager", "inductor")):
    parser.add_argument(
        "--target", metavar="DIR", help="saved target model folder (default: the default pair)"
    )
    parser.add_argument("--draft", metavar="DIR", help="saved draft model folder (default: the default pair)")
    parser.add_argument(
        "--k", type=int_at_least(1, "k", MAX_K), default=5, help=f"speculation length, 1..{MAX_K} (default 5)"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int_at_least(1, "max_new_tokens"),
        default=64,
        help="tokens to generate per prompt (default 64)",
    )
    parser.add_argument("--temperature", type=temperature_arg, default=0.0, help="0 for greedy (default 0)")
    parser.add_argument(
        "--backend",
        default="inductor",
        choices=list(backends),
        help="lowering backend (default inductor; eager starts at once, for debugging)"
        + ("; both: eager and inductor rows in one run" if "both" in backends else ""),
    )
    parser.add_argument(
        "--device", default="cpu", help="where both models run: cpu, cuda, cuda:1, ... (default cpu)"
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="weights dtype of both models (default float32)",
    )


PLANS = ("auto", "always-ssd")


def add_plan_arg(parser) -> None:
    parser.add_argument(
        "--plan",
        default="auto",
        choices=list(PLANS),
        help="auto: an SSD generation whose warm-up measures that no tree pays on this machine runs "
        "SD's rounds instead, and says so ('ran as SD'); always-ssd: SSD's own rounds on any "
        "machine (sd_when_faster=False). Default auto",
    )


def add_linears_arg(parser) -> None:
    from saguaro.core.config import LINEARS

    parser.add_argument(
        "--linears",
        default="auto",
        choices=list(LINEARS),
        help="how the linear layers of the stages run (SaguaroConfig.linears): auto (on a CPU with "
        "inductor, the packed C++ kernel, the prefill's included), gemm, reduction (the decode "
        "stages; the prefill keeps BLAS), packed, or template: as auto, with SD's verify (and "
        "SSD's glue and tree) on Inductor's C++ GEMM template over frozen weights, faster there "
        "but compiled again in every process. Default auto",
    )
    parser.add_argument(
        "--weights",
        default="as-loaded",
        choices=["as-loaded", "int8", "int4"],
        help="the target's linear weights (SaguaroConfig.weights): as loaded, or weight-only int8 / "
        "int4 (lossless with respect to the quantized target). Default as-loaded",
    )
    parser.add_argument(
        "--draft-weights",
        default=None,
        choices=["as-loaded", "int8", "int4"],
        help="the draft's linear weights (SaguaroConfig.draft_weights); default: as --weights",
    )
    parser.add_argument(
        "--weight-group-size",
        type=int,
        default=None,
        help="k per scale of quantized weights (default: per output column for int8, 64 for int4)",
    )
    parser.add_argument(
        "--narrow-weights",
        default="on",
        choices=["on", "off"],
        help="on: float32 weights whose values are all float16 (or bfloat16) values are held in that "
        "dtype in the stages whose linears are packed or reductions, widened inside the kernels: "
        "the same arithmetic, half the bytes (SaguaroConfig.narrow_weights). off: as loaded. "
        "Default on",
    )


def weight_options(args) -> dict:
    """The ``SaguaroConfig`` weight fields that ``--weights``, ``--draft-weights``, ``--weight-group-size``
    ask for."""
    return {
        "weights": args.weights,
        "draft_weights": args.draft_weights,
        "weight_group_size": args.weight_group_size,
    }


def sd_when_faster(args) -> bool:
    """The ``sd_when_faster`` option ``--plan`` asks for."""
    return args.plan != "always-ssd"


def modes_arg(text: str) -> list[str]:
    """An argparse ``type``: comma-separated row names, each one of :data:`ALL_MODES`."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(
            f"--modes {text!r} is not allowed ({', '.join(map(repr, unknown)) or 'empty'}): "
            f"choose from {', '.join(ALL_MODES)}"
        )
    return list(dict.fromkeys(modes))  # keep order, drop repeats


def add_bench_args(parser) -> None:
    parser.add_argument(
        "--prompts", type=int_at_least(1, "prompts"), default=8, help="number of prompts (default 8)"
    )
    parser.add_argument(
        "--batch", type=int_at_least(1, "batch"), default=1, help="prompts per generate call (default 1)"
    )
    parser.add_argument(
        "--modes",
        type=modes_arg,
        default=None,
        help=f"comma-separated rows, from {', '.join(ALL_MODES)} (default: every row that applies: "
        "hf-assisted only with --batch 1)",
    )
    parser.add_argument("--json", metavar="PATH", default=None, help="write the results here as JSON")
    parser.add_argument("--seed", type=int, default=0, help="seed for sampling and for random prompts")
    parser.add_argument(
        "--threads",
        type=int_at_least(1, "threads"),
        default=None,
        help="torch intra-op threads (default: torch's)",
    )
    parser.add_argument(
        "--repeats",
        type=int_at_least(1, "repeats"),
        default=3,
        help="timed passes per row, the rows' passes alternating (ar, sd, ..., ar, sd, ...); a row "
        "reports their median tokens/s and spread (default 3)",
    )
    parser.add_argument(
        "--same-process",
        action="store_true",
        help="run every row in this process (default: each row in a process of its own)",
    )
    parser.add_argument(
        "--trace",
        metavar="DIR",
        default=None,
        help="write a timeline (Chrome trace-event JSON, open in https://ui.perfetto.dev) of one "
        "extra call per Saguaro row into DIR",
    )
