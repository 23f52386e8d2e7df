"""The ``linears`` settings measured: the default pair compiled twice by Inductor in one process, by default
``linears="gemm"`` (every linear a BLAS call, as captured) and ``linears="auto"`` (on CPU the few-row
stages' linears as a product and a sum that Inductor fuses into one reduction reading each weight once).

    python benchmarks/parts/linear_as_reduction.py --threads 1 --passes 5 --json linears.json
    python benchmarks/parts/linear_as_reduction.py --compare auto,template   # the GEMM template of the verify

``--compare A,B`` names the two ``linears`` settings (default ``gemm,auto``). Both programs are warmed up in AR and SD (every shape compiled); then their timed passes alternate
(``--prompts`` held-out prompts x ``--new`` tokens each, greedy). Prints a table of medians with B/A and
whether every generation equals the target's own greedy ``generate``; writes JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def timed_pass(program, prompts: list, mode: str, new: int) -> tuple[float, float, list]:
    """Tokens per second of one pass over ``prompts`` (with the prefills, and after them: ``saguaro bench``'s
    ``TimedPass`` counts both) and the sequences it gave."""
    from saguaro.bench.passes import TimedPass

    timed, outputs = TimedPass(), []
    for ids in prompts:
        start = time.perf_counter()
        out = program.generate(ids, max_new_tokens=new, mode=mode)
        timed.add(out.stats["new_tokens"], time.perf_counter() - start, out)
        outputs.append(out.sequences)
    return timed.tokens_per_s, timed.decode_tokens_per_s, outputs


def pair_and_prompts(count: int, new: int) -> tuple:
    """The default pair, ``count`` held-out prompts that leave room for ``new`` tokens, and the target's own
    greedy ``generate`` of each: ``(target, draft, prompts, expected)``."""
    import saguaro
    from saguaro.bench.prompts import bench_prompts

    target, draft, tokenizer = saguaro.default_pair()
    prompts = bench_prompts(
        tokenizer,
        count,
        target.config.vocab_size,
        0,
        default_pair=True,
        max_tokens=target.config.max_position_embeddings - new,
    )
    with torch.no_grad():
        expected = [target.generate(ids, max_new_tokens=new, do_sample=False) for ids in prompts]
    return target, draft, prompts, expected


def equal_to_expected(outputs: list, expected: list) -> bool:
    """Whether every generated sequence begins with the target's own greedy ``generate``."""
    return all(torch.equal(got[:, : want.shape[1]], want) for got, want in zip(outputs, expected))


def main(argv=None) -> int:
    import saguaro

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--passes", type=int, default=5, help="timed passes per program and mode (default 5)")
    p.add_argument("--prompts", type=int, default=4, help="held-out prompts per pass (default 4)")
    p.add_argument("--new", type=int, default=128, help="new tokens per prompt (default 128)")
    p.add_argument("--k", type=int, default=5, help="SD's speculation length (default 5)")
    p.add_argument(
        "--compare", default="gemm,auto", help="the two linears settings compared, A,B (default gemm,auto)"
    )
    p.add_argument("--json", metavar="PATH", help="write the results here")
    args = p.parse_args(argv)
    settings = args.compare.split(",")
    if len(settings) != 2 or len(set(settings)) != 2:
        p.error(f"--compare {args.compare!r}: name two different linears settings, A,B")
    if args.threads:
        torch.set_num_threads(args.threads)
    target, draft, prompts, expected = pair_and_prompts(args.prompts, args.new)
    programs = {
        name: saguaro.compile(target, draft, k=args.k, mode="sd", backend="inductor", linears=linears)
        for name, linears in ((name, name) for name in settings)
    }
    rates = {(name, mode): [] for name in programs for mode in ("ar", "sd")}
    decode = {(name, mode): [] for name in programs for mode in ("ar", "sd")}
    exact = True
    for program in programs.values():  # warm-up: every shape compiled before the clock
        for mode in ("ar", "sd"):
            timed_pass(program, prompts, mode, args.new)
    for rep in range(args.passes):
        for mode in ("ar", "sd"):
            order = list(programs.items()) if rep % 2 == 0 else list(reversed(programs.items()))
            for name, program in order:
                rate, decode_rate, outputs = timed_pass(program, prompts, mode, args.new)
                rates[(name, mode)].append(rate)
                decode[(name, mode)].append(decode_rate)
                exact &= equal_to_expected(outputs, expected)
    for program in programs.values():
        program.close()
    rows = []
    print(
        f"threads {torch.get_num_threads()}, {args.prompts} prompts x {args.new} tokens, {args.passes} passes"
    )
    first, second = settings
    print(
        f"{'mode':<5}{first + ' tok/s':>16}{second + ' tok/s':>17}{'B/A':>7}{'after the prefill: A, B, B/A':>32}"
    )
    for mode in ("ar", "sd"):
        a, b = (statistics.median(rates[(name, mode)]) for name in programs)
        da, db = (statistics.median(decode[(name, mode)]) for name in programs)
        rows.append(
            {
                "mode": mode,
                first: a,
                second: b,
                "ratio": b / a,
                "decode": {first: da, second: db, "ratio": db / da},
                "runs": {name: rates[(name, mode)] for name in programs},
                "decode_runs": {name: decode[(name, mode)] for name in programs},
            }
        )
        print(f"{mode:<5}{a:>16.1f}{b:>17.1f}{b / a:>7.2f}{da:>14.1f}{db:>9.1f}{db / da:>9.2f}")
    print("every generation equals the target's greedy generate:", exact)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"threads": torch.get_num_threads(), "compare": settings, "exact": exact, "rows": rows},
                f,
                indent=2,
            )
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
