"""The harness of the one-program A/B scripts (``direct_calls.py``, ``ar_round.py``): their common options, and
timed passes that alternate between two forms of one warm program, so that the machine's drift falls on both.

A pass is ``--prompts`` held-out prompts x ``--new`` tokens each, greedy; a rate is tokens per second after the
prefill, as llama.cpp counts them (with ``--with-prefill``: over the whole generation, as ``saguaro bench``'s first
column); every generation is compared with the target's own greedy ``generate``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch


def ab_parser(doc: str) -> argparse.ArgumentParser:
    """The options every A/B script takes (``--threads``, ``--passes``, ``--prompts``, ``--new``, ``--json``)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--passes", type=int, default=5, help="timed passes per form and mode (default 5)")
    p.add_argument("--prompts", type=int, default=4, help="held-out prompts per pass (default 4)")
    p.add_argument("--new", type=int, default=128, help="new tokens per prompt (default 128)")
    p.add_argument(
        "--with-prefill", action="store_true", help="count the prefill in the rates (whole generations)"
    )
    p.add_argument("--json", metavar="PATH", help="write the results here")
    return p


def checked(p: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    args = p.parse_args(argv)
    if args.passes < 1:
        p.error(f"--passes {args.passes}: at least 1")
    return args


def modes_program(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple:
    """``args.modes`` checked (of ``ar`` and ``sd``), torch's threads set, the default pair compiled by Inductor
    (blocking; the draft where ``sd`` runs): ``(program, modes, prompts, expected)``."""
    from linear_as_reduction import pair_and_prompts  # this folder's script

    import saguaro

    modes = tuple(args.modes.split(","))
    if not modes or set(modes) - {"ar", "sd"}:
        parser.error(f"--modes {args.modes}: choose ar, sd or ar,sd")
    if args.threads:
        torch.set_num_threads(args.threads)
    target, draft, prompts, expected = pair_and_prompts(args.prompts, args.new)
    program = saguaro.compile(
        target, draft if "sd" in modes else None, mode="ar", backend="inductor", compile="blocking"
    )
    return program, modes, prompts, expected


def alternate(
    program, forms: tuple, use_form, modes: tuple, args, prompts: list, expected: list
) -> tuple[dict, bool]:
    """Warm ``program`` up in every form and mode (every shape compiled), then ``args.passes`` timed passes per
    form and mode, the forms' order flipped every other pass (``use_form(form)`` switches; a program it returns
    runs that form instead of ``program``). Returns
    ``({(form, mode): [rates]}, whether every generation equalled expected)``."""
    from linear_as_reduction import equal_to_expected, timed_pass  # this folder's script

    exact, which = (
        True,
        0 if getattr(args, "with_prefill", False) else 1,
    )  # timed_pass's rate with or after the prefill
    for form in forms:
        prog = use_form(form) or program
        for mode in modes:
            exact &= equal_to_expected(timed_pass(prog, prompts, mode, args.new)[2], expected)
    rates = {(form, mode): [] for form in forms for mode in modes}
    for rep in range(args.passes):
        for mode in modes:
            for form in forms if rep % 2 == 0 else forms[::-1]:
                prog = use_form(form) or program
                timed = timed_pass(prog, prompts, mode, args.new)
                rates[(form, mode)].append(timed[which])
                outputs = timed[2]
                exact &= equal_to_expected(outputs, expected)
    return rates, exact


def report(forms: tuple, modes: tuple, rates: dict, exact: bool, args) -> list[dict]:
    """Print the table of medians (second form / first) and write the JSON ``args.json`` names."""
    a, b = forms
    rows = [
        {
            "mode": mode,
            **{form: statistics.median(rates[(form, mode)]) for form in forms},
            "passes": {form: rates[(form, mode)] for form in forms},
        }
        for mode in modes
    ]
    counted = "with" if getattr(args, "with_prefill", False) else "after"
    print(
        f"threads {torch.get_num_threads()}; tokens/s {counted} the prefill, medians of {args.passes} passes"
    )
    print(f"{'mode':<6}{a:>9}{b:>9}{f'{b}/{a}':>15}")
    for row in rows:
        print(f"{row['mode']:<6}{row[a]:>9.1f}{row[b]:>9.1f}{row[b] / row[a]:>15.3f}")
    print("every generation equals the target's greedy generate:", exact)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "threads": torch.get_num_threads(),
                    "rows": rows,
                    "exact": exact,
                    "with_prefill": counted == "with",
                },
                indent=2,
            )
        )
    return rows


if __name__ == "__main__":  # a harness, not a benchmark of its own: say so and what runs it
    ab_parser(
        __doc__ + "\nNot a benchmark by itself: run ar_round.py or direct_calls.py, which take these options."
    ).parse_args()
    raise SystemExit("alternating.py is the harness of ar_round.py and direct_calls.py: run one of those")
