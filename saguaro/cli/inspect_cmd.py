"""``saguaro inspect passes|graph STAGE|schedule|kernels|weights``: what the compiler built, as text, DOT
or SVG. (Not ``inspect.py``: run as a script, that name would shadow the standard library's ``inspect``.)"""

from __future__ import annotations

import sys
from pathlib import Path

from saguaro.cli.args import add_model_args
from saguaro.cli.program import compile_ssd_pair
from saguaro.cli.registry import Subcommand
from saguaro.core.config import MODES


def add_arguments(ins) -> None:
    views = ins.add_subparsers(dest="view", required=True)
    passes = views.add_parser(
        "passes", help="per stage: each pass and the node-count change; --pass: its diff"
    )
    passes.add_argument(
        "--stage", help="one stage, e.g. target.verify_greedy or verify_greedy (default: all)"
    )
    passes.add_argument(
        "--pass",
        dest="pass_name",
        help="print the unified diff of the graph code before/after this pass (needs --stage)",
    )
    graph = views.add_parser("graph", help="a stage's graph as text, DOT or SVG")
    graph.add_argument("stage", help="e.g. target.verify_greedy, draft.glue")
    graph.add_argument("--format", default="text", choices=["text", "dot", "svg"])
    graph.add_argument(
        "--expand", action="store_true", help="every node (default: one box per decoder layer)"
    )
    schedule = views.add_parser(
        "schedule", help="the round DAG of a mode (lanes as clusters, measured costs, critical path in red)"
    )
    schedule.add_argument("--mode", default="ssd", choices=list(MODES))
    schedule.add_argument("--format", default="dot", choices=["text", "dot", "svg"])
    schedule.add_argument(
        "--no-measure", action="store_true", help="skip the short run that measures stage costs"
    )
    kernels = views.add_parser("kernels", help="Inductor's generated kernels and compile time per stage")
    kernels.add_argument("--mode", default="ssd", choices=list(MODES))
    weights = views.add_parser(
        "weights",
        help="the bytes of weights the program holds, by form (as loaded, narrow, "
        "panels) and model, after a short generation in each mode",
    )
    weights.add_argument("--mode", default="ssd", choices=list(MODES))
    for view in (passes, graph, schedule, kernels, weights):
        view.add_argument("--out", metavar="FILE", help="write here instead of stdout")
        add_model_args(view)


def _emit(text: str, out: str | None) -> None:
    if out:
        Path(out).write_text(text)
        sys.stdout.write(f"wrote {out}\n")
    else:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")


def run(args) -> int:
    from saguaro.inspection.inspector import Inspector, format_kernels, resolve_stage

    if args.view == "passes" and args.pass_name and not args.stage:
        raise ValueError("--pass needs --stage: the diff is of one stage's graph")
    stage = getattr(args, "stage", None)
    if stage:
        resolve_stage(stage)  # a bad name fails before any model loads
    program, _ = compile_ssd_pair(args)
    inspector = Inspector(program)
    try:
        if args.view == "passes":
            text = (
                inspector.pass_diff(args.stage, args.pass_name)
                if args.pass_name
                else inspector.passes(args.stage)
            )
        elif args.view == "graph":
            text = inspector.graph(args.stage, format=args.format, expand=args.expand)
        elif args.view == "schedule":
            text = inspector.schedule(args.mode, format=args.format, measure=not args.no_measure)
        elif args.view == "weights":
            from saguaro.inspection.weights import format_weights

            text = format_weights(inspector.weights(modes=(args.mode,)))
        else:
            text = format_kernels(inspector.kernels(args.mode))
    finally:
        program.close()
    _emit(text, args.out)
    return 0


COMMAND = Subcommand(
    "inspect",
    "what the compiler built: pass pipeline, stage graphs, the round schedule, Inductor's kernels",
    add_arguments,
    run,
)
