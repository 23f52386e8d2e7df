"""The ``linear_as_reduction`` pass measured: the default pair compiled twice by Inductor in one process,
``linears="gemm"`` (every linear a BLAS call, as captured) and ``linears="auto"`` (on CPU the few-row
stages' linears as a product and a sum that Inductor fuses into one reduction reading each weight once).

    python benchmarks/linear_as_reduction.py --threads 1 --passes 5 --json linears.json

Both programs are warmed up in AR and SD (every shape compiled); then their timed passes alternate
(``--prompts`` held-out prompts x ``--new`` tokens each, greedy). Prints a table of medians with B/A and
whether every generation equals the target's own greedy ``generate``; writes JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def timed_pass(program, prompts: list, mode: str, new: int) -> tuple[float, list]:
    """Tokens per second of one pass over ``prompts`` and the sequences it gave."""
    tokens, wall, outputs = 0, 0.0, []
    for ids in prompts:
        start = time.perf_counter()
        out = program.generate(ids, max_new_tokens=new, mode=mode)
        wall += time.perf_counter() - start
        tokens += out.stats["new_tokens"]
        outputs.append(out.sequences)
    return tokens / wall, outputs


def main(argv=None) -> int:
    import saguaro
    from saguaro.bench.prompts import bench_prompts

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--passes", type=int, default=5, help="timed passes per program and mode (default 5)")
    p.add_argument("--prompts", type=int, default=4, help="held-out prompts per pass (default 4)")
    p.add_argument("--new", type=int, default=128, help="new tokens per prompt (default 128)")
    p.add_argument("--k", type=int, default=5, help="SD's speculation length (default 5)")
    p.add_argument("--json", metavar="PATH", help="write the results here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target, draft, tokenizer = saguaro.default_pair()
    prompts = bench_prompts(tokenizer, args.prompts, target.config.vocab_size, 0, default_pair=True,
                            max_tokens=target.config.max_position_embeddings - args.new)
    with torch.no_grad():
        expected = [target.generate(ids, max_new_tokens=args.new, do_sample=False) for ids in prompts]
    programs = {name: saguaro.compile(target, draft, k=args.k, mode="sd", backend="inductor", linears=linears)
                for name, linears in (("gemm", "gemm"), ("reduction", "auto"))}
    rates = {(name, mode): [] for name in programs for mode in ("ar", "sd")}
    exact = True
    for program in programs.values():  # warm-up: every shape compiled before the clock
        for mode in ("ar", "sd"):
            timed_pass(program, prompts, mode, args.new)
    for rep in range(args.passes):
        for mode in ("ar", "sd"):
            order = list(programs.items()) if rep % 2 == 0 else list(reversed(programs.items()))
            for name, program in order:
                rate, outputs = timed_pass(program, prompts, mode, args.new)
                rates[(name, mode)].append(rate)
                exact &= all(torch.equal(got[:, :want.shape[1]], want) for got, want in zip(outputs, expected))
    for program in programs.values():
        program.close()
    rows = []
    print(f"threads {torch.get_num_threads()}, {args.prompts} prompts x {args.new} tokens, {args.passes} passes")
    print(f"{'mode':<5}{'gemm tok/s':>12}{'reduction tok/s':>17}{'ratio':>8}")
    for mode in ("ar", "sd"):
        a, b = (statistics.median(rates[(name, mode)]) for name in programs)
        rows.append({"mode": mode, "gemm": a, "reduction": b, "ratio": b / a,
                     "runs": {name: rates[(name, mode)] for name in programs}})
        print(f"{mode:<5}{a:>12.1f}{b:>17.1f}{b / a:>8.2f}")
    print("every generation equals the target's greedy generate:", exact)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "exact": exact, "rows": rows}, f, indent=2)
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
