"""``saguaro bench``: AR, SD, SSD and transformers (assisted) generation over the same prompts, printed as a
table and optionally written as JSON; with ``--program DIR``, the rows of an exported program."""

from __future__ import annotations

import sys

from saguaro.cli.args import (
    add_bench_args,
    add_linears_arg,
    add_model_args,
    add_plan_arg,
    sd_when_faster,
    weight_options,
)
from saguaro.cli.program import add_program_arg, check_program_args, load_program
from saguaro.cli.registry import Subcommand


def add_arguments(bench) -> None:
    add_bench_args(bench)
    add_plan_arg(bench)
    add_model_args(bench, backends=("eager", "inductor", "both"))
    add_linears_arg(bench)
    add_program_arg(bench)


def run(args) -> int:
    from saguaro.bench.report import format_table, write_json
    from saguaro.bench.run import BenchParams, run_bench

    check_program_args(args)
    if args.program is not None:
        return _bench_program(args)
    params = BenchParams(
        target=args.target,
        draft=args.draft,
        modes=tuple(args.modes) if args.modes else None,
        prompts=args.prompts,
        batch=args.batch,
        k=args.k,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        backend=args.backend,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        threads=args.threads,
        same_process=args.same_process,
        trace_dir=args.trace,
        plan=args.plan,
        repeats=args.repeats,
        linears=args.linears,
        narrow_weights=args.narrow_weights == "on",
        **weight_options(args),
    )
    report = run_bench(params, announce=lambda line: sys.stdout.write(line + "\n"))
    sys.stdout.write(format_table(report["rows"]) + "\n")
    for mode, reason in report["skipped"].items():
        sys.stdout.write(f"skipped {mode}: {reason}\n")
    if args.json:
        sys.stdout.write(f"wrote {write_json(report, args.json)}\n")
    return 0


def _bench_program(args) -> int:
    from saguaro.bench.passes import interleaved
    from saguaro.bench.prompts import prompt_set
    from saguaro.bench.report import format_table, write_json
    from saguaro.bench.rows import SAGUARO_MODES, run_rows

    program, tokenizer = load_program(args)
    if not sd_when_faster(args):
        program = program.reconfigure(sd_when_faster=False)
    modes = [m for m in (args.modes or SAGUARO_MODES) if m in SAGUARO_MODES]
    if program.draft is None:
        modes = [m for m in modes if m == "ar"]
    # an artifact does not say which pair it holds, so its prompts are the fixed ones (or random ids)
    prompts = prompt_set(
        tokenizer, args.prompts, program.target.spec.vocab_size, args.seed, default_pair=False
    )
    sys.stdout.write(f"prompts ({prompts.source}): {prompts.detail}\n")
    try:
        rows = run_rows(
            None,
            None,
            prompts.ids,
            modes,
            program.config.k,
            args.max_new_tokens,
            args.temperature,
            args.batch,
            args.seed,
            program=program,
            repeats=args.repeats,
        )
    finally:
        program.close()  # its lane (a draft process) ends with the run, whether the rows ran or raised
    sys.stdout.write(format_table(rows) + "\n")
    if args.json:
        config = {"repeats": args.repeats, "order": interleaved(modes, args.repeats)}
        report = {"program": args.program, "config": config, "prompts": prompts.describe(), "rows": rows}
        sys.stdout.write(f"wrote {write_json(report, args.json)}\n")
    return 0


COMMAND = Subcommand(
    "bench",
    "AR, SD, SSD and transformers (assisted) generation over the same prompts: a table and JSON",
    add_arguments,
    run,
)
