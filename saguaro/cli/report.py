"""``saguaro report OUT.html``: one self-contained HTML page about a compiled pair and one generate call."""

from __future__ import annotations

import sys

from saguaro.cli.args import add_model_args, add_plan_arg
from saguaro.cli.program import compile_ssd_pair
from saguaro.cli.registry import Subcommand


def add_arguments(report) -> None:
    report.add_argument("out", metavar="OUT.html")
    report.add_argument(
        "--prompt", default=None, help="text to complete (default: the start of a Python script)"
    )
    add_plan_arg(report)
    add_model_args(report)


def run(args) -> int:
    from saguaro.inspection.report import write_report

    program, tokenizer = compile_ssd_pair(args)
    try:
        prompt = {"prompt": args.prompt} if args.prompt else {}
        path = write_report(
            program,
            args.out,
            tokenizer=tokenizer,
            **prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
        )
    finally:
        program.close()
    sys.stdout.write(f"wrote {path}\n")
    return 0


COMMAND = Subcommand(
    "report",
    "one self-contained HTML page: schedule, timeline, acceptance, cache hits, fan-out, stats, stage graphs",
    add_arguments,
    run,
)
