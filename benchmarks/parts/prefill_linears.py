"""The prefill's linears on the packed kernel (``linears="auto"`` on Inductor/CPU) against MKL's GEMM over the
float32 weights (the prefill as it ran before): the default pair compiled once by Inductor, its prefill stages
(the target's and the draft's) built both ways, then timed passes alternating between the two forms. Short
generations from short prompts (the demo's, ``saguaro bench``'s) spend a large share of their time in the
prefill, so the rates count it by default here (``--after-prefill`` for the decode alone).

    python benchmarks/parts/prefill_linears.py --modes ar,sd --new 64 --passes 8 --json prefill_linears.json

Passes, the table and the JSON as ``alternating.py`` describes; the table's last column is packed/gemm.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

FORMS = ("gemm", "packed")


def prefill_forms(program) -> dict:
    """``{form: {runner: {prefill stage: lowered callable}}}``: each model's prefill built both ways (the packed form
    by the program's own choice, the GEMM one as ``linears="reduction"`` builds a prefill)."""
    from saguaro.core.stages import DRAFT_PREFILL, TARGET_PREFILL

    forms = {form: {} for form in FORMS}
    for runner, stage in ((program.target, TARGET_PREFILL), (program.draft, DRAFT_PREFILL)):
        if runner is None:
            continue
        builder = runner.build
        if builder.linears_of(stage) != "packed":
            raise SystemExit(
                f"{stage.qualified} is not on the packed kernel here ({builder.linears_of(stage)}): "
                "nothing to compare"
            )
        forms["packed"][runner] = {stage: runner.stage(stage)}
        forms["gemm"][runner] = {stage: builder(stage, linears="gemm")}
    return forms


def use_prefill(forms: dict, form: str) -> None:
    """Make each runner's next prefill call ``form``'s (the runner's built stages hold it)."""
    for runner, stages in forms[form].items():
        runner._stages.update(stages)


def main(argv=None) -> int:
    from alternating import ab_parser, alternate, checked, modes_program, report  # this folder's harness

    parser = ab_parser(__doc__)
    parser.add_argument("--modes", default="ar,sd", help="comma-separated, of ar and sd (default ar,sd)")
    parser.add_argument(
        "--after-prefill",
        dest="with_prefill",
        action="store_false",
        help="rates after the prefill (the decode alone); by default whole generations",
    )
    parser.set_defaults(with_prefill=True)
    args = checked(parser, argv)
    program, modes, prompts, expected = modes_program(parser, args)
    forms = prefill_forms(program)
    rates, exact = alternate(
        program, FORMS, lambda form: use_prefill(forms, form), modes, args, prompts, expected
    )
    program.close()
    report(FORMS, modes, rates, exact, args)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
