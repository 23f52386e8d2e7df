"""``saguaro export OUT`` and the ``--program DIR`` option of ``saguaro generate`` / ``saguaro bench``:
compile once, export, and load the artifact elsewhere with nothing captured or compiled."""

from __future__ import annotations

import argparse
import sys
import time

from saguaro.cli.args import add_model_args, modes_arg
from saguaro.core.config import MODES
from saguaro.core.errors import SaguaroError


def add_export_parser(sub) -> None:
    export = sub.add_parser("export", help="compile a pair ahead of time (AOTInductor) and write it to a folder that "
                                           "`saguaro.load` / `--program DIR` load")
    export.add_argument("out", metavar="OUT", help="folder to write (replaced atomically if it exists)")
    export.add_argument("--modes", type=_program_modes, default=None,
                        help="comma-separated modes to export, from ar, sd, ssd (default: all)")
    export.add_argument("--no-sampling", action="store_true", help="export only the greedy stages")
    export.add_argument("--portable", action="store_true",
                        help="write only the portable form (no native code; the stages run as exported graphs)")
    export.add_argument("--max-batch", type=int, default=64, help="largest batch the exported stages accept "
                        "(default 64)")
    add_model_args(export)


def add_program_arg(parser) -> None:
    parser.add_argument("--program", metavar="DIR", default=None,
                        help="load a program exported by `saguaro export` instead of compiling --target/--draft")


def _program_modes(text: str) -> list[str]:
    modes = modes_arg(text)
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise argparse.ArgumentTypeError(f"--modes {text!r}: {bad} cannot be exported; choose from {', '.join(MODES)}")
    return modes


def cmd_export(args) -> int:
    from saguaro.compile import compile as saguaro_compile
    from saguaro.models_io import DTYPES, load_pair

    modes = args.modes or list(MODES)
    need_draft = modes != ["ar"]
    target, draft, tokenizer = load_pair(args.target, args.draft, need_draft=need_draft, dtype=DTYPES[args.dtype],
                                         device=args.device)
    started = time.perf_counter()
    program = saguaro_compile(target, draft if need_draft else None, k=args.k, mode=modes[-1], backend=args.backend)
    sys.stdout.write(f"captured the pair in {time.perf_counter() - started:.1f}s\n")
    program.export(args.out, modes=modes, sampling=not args.no_sampling, native=not args.portable,
                   max_batch=args.max_batch, tokenizer=tokenizer, announce=lambda line: sys.stdout.write(line + "\n"))
    sys.stdout.write(f"total {time.perf_counter() - started:.1f}s\n")
    return 0


def load_program(args):
    """``(program, tokenizer or None)`` from ``--program DIR``."""
    import saguaro

    started = time.perf_counter()
    program = saguaro.load(args.program, device=None if args.device == "cpu" else args.device)
    tokenizer = None
    if program.tokenizer_path is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(program.tokenizer_path)
    sys.stdout.write(f"loaded {args.program} in {time.perf_counter() - started:.2f}s\n")
    return program, tokenizer


def check_program_args(args) -> None:
    if args.program is not None and (args.target is not None or args.draft is not None):
        raise SaguaroError("--program DIR loads an exported program: do not give --target / --draft with it")
