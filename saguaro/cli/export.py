"""``saguaro export OUT``: compile a pair once and write it ahead of time (AOTInductor) to a folder that
``saguaro.load`` and ``--program DIR`` load elsewhere with nothing captured or compiled."""

from __future__ import annotations

import argparse
import sys
import time

from saguaro.cli.args import add_model_args, modes_arg
from saguaro.cli.registry import Subcommand
from saguaro.core.config import MODES


def add_arguments(export) -> None:
    export.add_argument("out", metavar="OUT", help="folder to write (replaced atomically if it exists)")
    export.add_argument(
        "--modes",
        type=_program_modes,
        default=None,
        help="comma-separated modes to export, from ar, sd, ssd (default: all)",
    )
    export.add_argument("--no-sampling", action="store_true", help="export only the greedy stages")
    export.add_argument(
        "--portable",
        action="store_true",
        help="write only the portable form (no native code; the stages run as exported graphs)",
    )
    export.add_argument(
        "--max-batch", type=int, default=64, help="largest batch the exported stages accept (default 64)"
    )
    add_model_args(export)


def _program_modes(text: str) -> list[str]:
    modes = modes_arg(text)
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise argparse.ArgumentTypeError(
            f"--modes {text!r}: {bad} cannot be exported; choose from {', '.join(MODES)}"
        )
    return modes


def run(args) -> int:
    from saguaro.compile import compile as saguaro_compile
    from saguaro.models_io import DTYPES, load_pair

    modes = args.modes or list(MODES)
    need_draft = modes != ["ar"]
    target, draft, tokenizer = load_pair(
        args.target, args.draft, need_draft=need_draft, dtype=DTYPES[args.dtype], device=args.device
    )
    started = time.perf_counter()
    program = saguaro_compile(
        target, draft if need_draft else None, k=args.k, mode=modes[-1], backend=args.backend
    )
    sys.stdout.write(f"captured the pair in {time.perf_counter() - started:.1f}s\n")
    program.export(
        args.out,
        modes=modes,
        sampling=not args.no_sampling,
        native=not args.portable,
        max_batch=args.max_batch,
        tokenizer=tokenizer,
        announce=lambda line: sys.stdout.write(line + "\n"),
    )
    sys.stdout.write(f"total {time.perf_counter() - started:.1f}s\n")
    return 0


COMMAND = Subcommand(
    "export",
    "compile a pair ahead of time (AOTInductor) and write it to a folder that "
    "`saguaro.load` / `--program DIR` load",
    add_arguments,
    run,
)
