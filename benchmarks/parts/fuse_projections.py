"""The ``fuse_projections`` pass measured: the default pair compiled twice by Inductor in one process (the
few-row stages' q/k/v and gate/up joined, and apart as by default on a CPU), warmed up in AR and SD (every shape
compiled), then timed passes that alternate between the two programs.

    python benchmarks/parts/fuse_projections.py --threads 1 --passes 5 --json fuse_projections.json

Passes, the table and the JSON as ``alternating.py`` describes; the table's last column is joined/apart.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

FORMS = ("apart", "joined")


class Switch:
    """One ``generate`` over two programs: the one ``form`` names."""

    def __init__(self, programs: dict):
        self.programs, self.form = programs, FORMS[0]

    def generate(self, *args, **kwargs):
        return self.programs[self.form].generate(*args, **kwargs)


def main(argv=None) -> int:
    from alternating import ab_parser, alternate, checked, report  # this folder's harness
    from linear_as_reduction import pair_and_prompts

    import saguaro

    p = ab_parser(__doc__)
    p.add_argument("--k", type=int, default=5, help="SD's speculation length (default 5)")
    args = checked(p, argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target, draft, prompts, expected = pair_and_prompts(args.prompts, args.new)
    programs = {
        form: saguaro.compile(target, draft, k=args.k, mode="sd", backend="inductor", compile="blocking")
        for form in FORMS
    }
    for runner in (programs["joined"].target, programs["joined"].draft):
        runner.build.fuse_projections = True  # off on a CPU by default; before its first stage is built
    switch = Switch(programs)
    rates, exact = alternate(
        switch, FORMS, lambda form: setattr(switch, "form", form), ("ar", "sd"), args, prompts, expected
    )
    for program in programs.values():
        program.close()
    report(FORMS, ("ar", "sd"), rates, exact, args)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
