"""Stage calls past dynamo (``saguaro/lower/direct_call.py``) measured: the default pair compiled once by
Inductor, warmed up in AR and SD (every shape compiled, every stage's direct calls learnt), then timed passes
that alternate between the stages' direct calls and dynamo's path (the same compiled code behind both).

    python benchmarks/direct_calls.py --threads 1 --passes 5 --json direct_calls.json

A pass is ``--prompts`` held-out prompts x ``--new`` tokens each, greedy. Prints a table of medians (tokens per
second after the prefill, as llama.cpp counts them) with direct/dynamo and whether every generation equals the
target's own greedy ``generate``; writes JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

FORMS = ("dynamo", "direct")


def compiled_stages(program) -> list:
    """The built stages of ``program`` that can call past dynamo (``CompiledStage``s)."""
    runners = [r for r in (program.target, program.draft) if r is not None]
    return [fn for r in runners for fn in r.built_stages.values() if hasattr(fn, "direct_calls")]


def use_direct_calls(stages: list, on: bool) -> None:
    """Send every call of ``stages`` past dynamo where it learnt how (``on``), or through dynamo."""
    for stage in stages:
        stage.direct_calls = on


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--passes", type=int, default=5, help="timed passes per form and mode (default 5)")
    p.add_argument("--prompts", type=int, default=4, help="held-out prompts per pass (default 4)")
    p.add_argument("--new", type=int, default=128, help="new tokens per prompt (default 128)")
    p.add_argument("--k", type=int, default=5, help="SD's speculation length (default 5)")
    p.add_argument("--linears", default="auto", help="the program's linears setting (default auto)")
    p.add_argument("--json", metavar="PATH", help="write the results here")
    args = p.parse_args(argv)
    if args.passes < 1:
        p.error(f"--passes {args.passes}: at least 1")
    return args


def main(argv=None) -> int:
    import saguaro
    from linear_as_reduction import equal_to_expected, pair_and_prompts, timed_pass  # this folder's script

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target, draft, prompts, expected = pair_and_prompts(args.prompts, args.new)
    program = saguaro.compile(target, draft, k=args.k, mode="sd", backend="inductor", compile="blocking",
                              linears=args.linears)
    modes, exact = ("ar", "sd"), True
    for mode in modes:  # warm-up: every shape compiled, every direct call learnt
        exact &= equal_to_expected(timed_pass(program, prompts, mode, args.new)[2], expected)
    stages = compiled_stages(program)
    rates = {(form, mode): [] for form in FORMS for mode in modes}
    for rep in range(args.passes):
        for mode in modes:
            for form in (FORMS if rep % 2 == 0 else FORMS[::-1]):
                use_direct_calls(stages, form == "direct")
                _, rate, outputs = timed_pass(program, prompts, mode, args.new)  # the rate after the prefill
                rates[(form, mode)].append(rate)
                exact &= equal_to_expected(outputs, expected)
    use_direct_calls(stages, True)
    program.close()
    rows = [{"mode": mode, **{form: statistics.median(rates[(form, mode)]) for form in FORMS},
             "passes": {form: rates[(form, mode)] for form in FORMS}} for mode in modes]
    print(f"threads {torch.get_num_threads()}; tokens/s after the prefill, medians of {args.passes} passes")
    print(f"{'mode':<6}{'dynamo':>9}{'direct':>9}{'direct/dynamo':>15}")
    for row in rows:
        print(f"{row['mode']:<6}{row['dynamo']:>9.1f}{row['direct']:>9.1f}{row['direct'] / row['dynamo']:>15.3f}")
    print("every generation equals the target's greedy generate:", exact)
    if args.json:
        Path(args.json).write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows, "exact": exact},
                                              indent=2))
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
