"""AR's greedy round in one stage call (``target.round_greedy``: the step, its argmax appended to the sequences
and the next slot claimed inside the graph) measured against AR by the step (``target.step``: logits out, then
the argmax, the append and the claim as tensor operations on the host): the default pair compiled once by
Inductor, warmed up in both forms, then timed AR passes alternating between them. With ``--modes ar,sd``
greedy SD too, by its round stage (``target.verify_round_greedy``: the verify, the append and the next
round's inputs in one call, the "round" column) against the verify and the host's commit ("step").

    python benchmarks/parts/ar_round.py --threads 1 --passes 5 --json ar_round.json
    python benchmarks/parts/ar_round.py --threads 1 --passes 5 --modes ar,sd --json rounds.json

Passes, the table and the JSON as ``alternating.py`` describes; the table's last column is round/step.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

FORMS = ("step", "round")


def use_round(program, on: bool) -> None:
    """Run greedy AR and SD by their round stages (``on``) or by the step and the verify, as a program whose
    builder lacks the round stages."""
    from saguaro.core.stages import ROUND_STAGES

    runner = program.target
    if on:
        runner.__dict__.pop("provides", None)
    else:
        runner.provides = lambda stage: stage not in ROUND_STAGES


def main(argv=None) -> int:
    from alternating import ab_parser, alternate, checked, modes_program, report  # this folder's harness

    parser = ab_parser(__doc__)
    parser.add_argument("--modes", default="ar", help="comma-separated, of ar and sd (default ar)")
    args = checked(parser, argv)
    program, modes, prompts, expected = modes_program(parser, args)
    rates, exact = alternate(
        program, FORMS, lambda form: use_round(program, form == "round"), modes, args, prompts, expected
    )
    use_round(program, True)
    program.close()
    report(FORMS, modes, rates, exact, args)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
