"""The program a subcommand runs: loaded from ``--program DIR`` (a folder ``saguaro export`` wrote, nothing
captured or compiled) or compiled from ``--target`` / ``--draft``."""

from __future__ import annotations

import sys
import time

from saguaro.core.errors import SaguaroError


def add_program_arg(parser) -> None:
    parser.add_argument(
        "--program",
        metavar="DIR",
        default=None,
        help="load a program exported by `saguaro export` instead of compiling --target/--draft",
    )


def check_program_args(args) -> None:
    if args.program is not None and (args.target is not None or args.draft is not None):
        raise SaguaroError("--program DIR loads an exported program: do not give --target / --draft with it")


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


def compile_ssd_pair(args):
    """``(program, tokenizer or None)``: the ``--target`` / ``--draft`` pair compiled in SSD mode (which
    builds every stage), for the subcommands that look at what the compiler built; ``--plan always-ssd``
    (where the subcommand has it): ``sd_when_faster=False``."""
    from saguaro.compile import compile as saguaro_compile
    from saguaro.models_io import DTYPES, load_pair

    target, draft, tokenizer = load_pair(
        args.target, args.draft, need_draft=True, dtype=DTYPES[args.dtype], device=args.device
    )
    program = saguaro_compile(
        target,
        draft,
        k=args.k,
        mode="ssd",
        backend=args.backend,
        sd_when_faster=getattr(args, "plan", "auto") != "always-ssd",
    )
    return program, tokenizer
