"""AR's greedy round in one stage call (``target.round_greedy``: the step, its argmax appended to the sequences
and the next slot claimed inside the graph) measured against AR by the step (``target.step``: logits out, then
the argmax, the append and the claim as tensor operations on the host): the default pair compiled once by
Inductor, warmed up in both forms, then timed AR passes alternating between them.

    python benchmarks/parts/ar_round.py --threads 1 --passes 5 --json ar_round.json

Passes, the table and the JSON as ``alternating.py`` describes; the table's last column is round/step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

FORMS = ("step", "round")


def use_round(program, on: bool) -> None:
    """Run greedy AR by the round stage (``on``) or by the step, as a program whose builder lacks the round."""
    from saguaro.core.stages import TARGET_ROUND

    runner = program.target
    if on:
        runner.__dict__.pop("provides", None)
    else:
        runner.provides = lambda stage: stage is not TARGET_ROUND


def main(argv=None) -> int:
    import saguaro
    from alternating import ab_parser, alternate, checked, report  # this folder's harness
    from linear_as_reduction import pair_and_prompts

    args = checked(ab_parser(__doc__), argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target, draft, prompts, expected = pair_and_prompts(args.prompts, args.new)
    program = saguaro.compile(target, None, mode="ar", backend="inductor", compile="blocking")
    rates, exact = alternate(program, FORMS, lambda form: use_round(program, form == "round"), ("ar",), args,
                             prompts, expected)
    use_round(program, True)
    program.close()
    report(FORMS, ("ar",), rates, exact, args)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
