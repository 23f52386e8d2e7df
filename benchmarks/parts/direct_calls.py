"""Stage calls past dynamo (``saguaro/lower/direct_call.py``) measured: the default pair compiled once by
Inductor, warmed up in AR and SD (every shape compiled, every stage's direct calls learnt), then timed passes
that alternate between the stages' direct calls and dynamo's path (the same compiled code behind both).

    python benchmarks/parts/direct_calls.py --threads 1 --passes 5 --json direct_calls.json

Passes, the table and the JSON as ``alternating.py`` describes; the table's last column is direct/dynamo.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

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
    from alternating import ab_parser, checked  # this folder's harness

    p = ab_parser(__doc__)
    p.add_argument("--k", type=int, default=5, help="SD's speculation length (default 5)")
    p.add_argument("--linears", default="auto", help="the program's linears setting (default auto)")
    return checked(p, argv)


def main(argv=None) -> int:
    from alternating import alternate, report
    from linear_as_reduction import pair_and_prompts

    import saguaro

    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target, draft, prompts, expected = pair_and_prompts(args.prompts, args.new)
    program = saguaro.compile(
        target, draft, k=args.k, mode="sd", backend="inductor", compile="blocking", linears=args.linears
    )
    modes = ("ar", "sd")
    # the stages are built by the warm-up's first passes (learning their direct calls): switch what exists
    rates, exact = alternate(
        program,
        FORMS,
        lambda form: use_direct_calls(compiled_stages(program), form == "direct"),
        modes,
        args,
        prompts,
        expected,
    )
    use_direct_calls(compiled_stages(program), True)
    program.close()
    report(FORMS, modes, rates, exact, args)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
