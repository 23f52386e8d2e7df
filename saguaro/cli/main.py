"""Command line: ``saguaro SUBCOMMAND``, one module per subcommand (listed in :data:`SUBCOMMAND_MODULES`).

Bad arguments exit with status 2 and a message naming the value: argparse rejects malformed values
before any model is loaded, and ``main`` turns a ``ValueError`` / ``SaguaroError`` raised later
(a missing folder, a model that will not load, the default pair not built) into the same status.
"""

from __future__ import annotations

import argparse
import logging
import sys
from contextlib import contextmanager

from saguaro.cli.registry import Subcommand, load
from saguaro.core.errors import SaguaroError

# The modules under saguaro/cli/ that each declare one subcommand (``COMMAND``), named after it;
# ``saguaro --help`` lists them in this order. A new subcommand is a new module plus its name here.
SUBCOMMAND_MODULES = ("generate", "bench", "export", "inspect_cmd", "report", "draft_server", "serve")


def subcommands() -> dict[str, Subcommand]:
    """``{name: Subcommand}`` for every subcommand, in :data:`SUBCOMMAND_MODULES` order."""
    return load("saguaro.cli", SUBCOMMAND_MODULES)


def build_parser(commands: dict[str, Subcommand] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="saguaro", description="Speculative speculative decoding for HF causal LMs"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress (capture, compile)")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (commands or subcommands()).values():
        command.add_arguments(sub.add_parser(command.name, help=command.help))
    return parser


@contextmanager
def _quiet_transformers(quiet: bool):
    """Hide transformers' weight-loading progress bars and warnings (shown with -v); restore them after,
    since ``main`` may run inside another program (the tests, a notebook)."""
    from transformers.utils import logging as hf_logging

    if not quiet:
        yield
        return
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def main(argv=None) -> int:
    commands = subcommands()
    args = build_parser(commands).parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    try:
        with _quiet_transformers(not args.verbose):
            return commands[args.command].run(args)
    except (SaguaroError, ValueError) as exc:
        sys.stderr.write(f"saguaro: error: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
