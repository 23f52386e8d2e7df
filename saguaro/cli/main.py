"""Command line: ``saguaro generate``, ``bench``, ``export``, ``inspect`` and ``report``.

Bad arguments exit with status 2 and a message naming the value: argparse rejects malformed values
before any model is loaded, and ``main`` turns a ``ValueError`` / ``SaguaroError`` raised later
(a missing folder, a model that will not load, the default pair not built) into the same status.
"""

from __future__ import annotations

import argparse
import logging
import sys
from contextlib import contextmanager

from saguaro.cli.args import add_bench_args, add_model_args
from saguaro.cli.program_args import (
    add_export_parser, add_program_arg, check_program_args, cmd_export, load_program,
)
from saguaro.cli.inspect_cmd import add_inspect_parsers, cmd_inspect, cmd_report
from saguaro.core.config import MODES
from saguaro.core.errors import SaguaroError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="saguaro", description="Speculative speculative decoding for HF causal LMs")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress (capture, compile)")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete a prompt and print the completion and a stats line")
    gen.add_argument("--prompt", required=True, help="text to complete")
    gen.add_argument("--mode", default="sd", choices=list(MODES),
                     help="ar: target alone; sd: speculative decoding; ssd: speculative speculative decoding "
                          "(default sd)")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--trace", metavar="FILE", default=None,
                     help="write a timeline of the call here (Chrome trace-event JSON: open it in "
                          "https://ui.perfetto.dev or chrome://tracing)")
    add_model_args(gen)
    add_program_arg(gen)
    bench = sub.add_parser("bench", help="AR, SD, SSD and transformers (assisted) generation over the same prompts: "
                                               "a table and JSON")
    add_bench_args(bench)
    add_model_args(bench, backends=("eager", "inductor", "both"))
    add_program_arg(bench)
    add_export_parser(sub)
    add_inspect_parsers(sub)
    return parser


def cmd_generate(args) -> int:
    if not args.prompt:
        raise ValueError("--prompt is empty: give some text to complete")
    from saguaro.compile import compile as saguaro_compile
    from saguaro.models_io import DTYPES, load_pair

    check_program_args(args)
    if args.program is not None:
        program, tokenizer = load_program(args)
        if tokenizer is None:
            raise SaguaroError(f"no tokenizer in the exported program {args.program!r}; generate needs one to read "
                               "--prompt (export with a tokenizer beside the target)")
    else:
        target, draft, tokenizer = load_pair(args.target, args.draft, need_draft=args.mode != "ar",
                                             dtype=DTYPES[args.dtype], device=args.device)
        if tokenizer is None:
            raise SaguaroError(f"no tokenizer beside the target in {args.target!r}; generate needs one to read "
                               "--prompt")
        if args.mode == "ar":
            draft = None  # AR never runs the draft: do not capture it
        program = saguaro_compile(target, draft, k=args.k, mode=args.mode, backend=args.backend)
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    out = program.generate(ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
                           trace=args.trace)
    completion = tokenizer.decode(out.sequences[0, ids.shape[1]:], skip_special_tokens=True)
    s = out.stats
    sys.stdout.write(args.prompt + completion + "\n")
    hits = f", cache hit rate {s['cache_hit_rate']:.2f}" if "cache_hit_rate" in s else ""
    sys.stdout.write(
        f"[{s['mode']}] {s['new_tokens']} tokens in {s['wall_s']:.2f}s: {s['tokens_per_s']:.1f} tokens/s, "
        f"mean accepted length {s['mean_accepted_len']:.2f}, {s['rounds']} rounds{hits}\n")
    if args.trace:
        sys.stdout.write(f"wrote the timeline to {args.trace} (open it in https://ui.perfetto.dev)\n")
    return 0


def cmd_bench(args) -> int:
    from saguaro.bench.run import BenchParams, run_bench
    from saguaro.bench.report import format_table, write_json

    check_program_args(args)
    if args.program is not None:
        return _bench_program(args)
    params = BenchParams(
        target=args.target, draft=args.draft, modes=tuple(args.modes) if args.modes else None, prompts=args.prompts,
        batch=args.batch, k=args.k, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        backend=args.backend, device=args.device, dtype=args.dtype, seed=args.seed, threads=args.threads,
        same_process=args.same_process, trace_dir=args.trace)
    report = run_bench(params, announce=lambda line: sys.stdout.write(line + "\n"))
    sys.stdout.write(format_table(report["rows"]) + "\n")
    for mode, reason in report["skipped"].items():
        sys.stdout.write(f"skipped {mode}: {reason}\n")
    if args.json:
        sys.stdout.write(f"wrote {write_json(report, args.json)}\n")
    return 0


def _bench_program(args) -> int:
    from saguaro.bench.report import format_table, write_json
    from saguaro.bench.rows import SAGUARO_MODES, bench_prompts, run_rows

    program, tokenizer = load_program(args)
    modes = [m for m in (args.modes or SAGUARO_MODES) if m in SAGUARO_MODES]
    if program.draft is None:
        modes = [m for m in modes if m == "ar"]
    prompts = bench_prompts(tokenizer, args.prompts, program.target.spec.vocab_size, args.seed)
    rows = run_rows(None, None, prompts, modes, program.config.k, args.max_new_tokens, args.temperature, args.batch,
                    args.seed, program=program)
    sys.stdout.write(format_table(rows) + "\n")
    if args.json:
        sys.stdout.write(f"wrote {write_json({'program': args.program, 'rows': rows}, args.json)}\n")
    program.close()
    return 0


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
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    try:
        with _quiet_transformers(not args.verbose):
            if args.command == "generate":
                return cmd_generate(args)
            if args.command == "export":
                return cmd_export(args)
            if args.command == "inspect":
                return cmd_inspect(args)
            if args.command == "report":
                return cmd_report(args)
            return cmd_bench(args)
    except (SaguaroError, ValueError) as exc:
        sys.stderr.write(f"saguaro: error: {exc}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
