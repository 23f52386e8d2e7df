"""A round's fed tokens in the draft's first call (``draft_decode``'s ``feeds_together``: after a round that
accepted every draft token, the token before the pending one and the pending one go in one two-token call) against
one at a time (a one-token catch-up call first, as before, and as where the draft's linears are reductions): the
default pair compiled once by Inductor, then greedy SD passes alternating between the two forms, with AR's for
SD/AR. Rates count the prefill by default (the demo's and ``saguaro bench``'s first column); ``--after-prefill``
for the decode alone.

    python benchmarks/parts/draft_feed.py --new 64 --passes 8 --json draft_feed.json

Passes, the table and the JSON as ``alternating.py`` describes; the table's last column is together/apart (AR
runs no draft: its column is the same form twice, a measure of the noise).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install

FORMS = ("apart", "together")


def use_feed(form: str) -> None:
    """Give ``draft_decode`` the fed tokens in one call (``"together"``, its own rule) or one at a time."""
    from saguaro.runtime.draft import decode

    real = getattr(decode, "_feeds_together_rule", decode.feeds_together)
    decode._feeds_together_rule = real
    decode.feeds_together = real if form == "together" else (lambda draft, stage: False)


def main(argv=None) -> int:
    from alternating import ab_parser, alternate, checked, report  # this folder's harness
    from linear_as_reduction import pair_and_prompts

    import saguaro
    from saguaro.core.stages import DRAFT_CHAIN
    from saguaro.runtime.draft import decode

    parser = ab_parser(__doc__)
    parser.add_argument(
        "--after-prefill",
        dest="with_prefill",
        action="store_false",
        help="rates after the prefill (the decode alone); by default whole generations",
    )
    parser.set_defaults(with_prefill=True)
    args = checked(parser, argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target, draft, prompts, expected = pair_and_prompts(args.prompts, args.new)
    program = saguaro.compile(target, draft, mode="sd", backend="inductor", compile="blocking")
    if not decode.feeds_together(program.draft, DRAFT_CHAIN):
        raise SystemExit(
            "the draft's chained step does not take its fed tokens together here: nothing to compare"
        )
    rates, exact = alternate(program, FORMS, use_feed, ("ar", "sd"), args, prompts, expected)
    use_feed("together")
    program.close()
    report(FORMS, ("ar", "sd"), rates, exact, args)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
