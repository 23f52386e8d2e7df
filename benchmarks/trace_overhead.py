"""What tracing costs: tokens/s of the same generations with and without ``trace=``, interleaved.

    python benchmarks/trace_overhead.py --mode ssd --reps 6 --prompts 4 --max-new-tokens 64

Each repetition decodes the prompts once untraced and once traced, as two blocks (which goes first
alternates), on the default pair (eager, one intra-op thread per lane). A block starts with one
unmeasured generation: in SSD the draft lane ends each generation with a build nobody needs, which
the next generation's first call waits for; a traced generation waits for it at its end instead (to
collect the draft side's events), so only back-to-back generations of one kind compare fairly. The
table shows the median tokens/s of each and the median of the per-repetition ratios (the two blocks
are adjacent in time, so a loaded machine's drift mostly cancels). Traced wall time includes
collecting the events and writing the JSON file. ``--json`` writes it all.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import saguaro
from saguaro.bench_rows import bench_prompts


def measure(mode: str, reps: int, prompts: int, max_new_tokens: int, k: int, lane: str = "auto") -> dict:
    torch.set_num_threads(1)
    target, draft, tokenizer = saguaro.default_pair()
    # sd_when_faster=False: SSD rounds on the lane even where the planner measures SD faster (it may here)
    program = saguaro.compile(target, draft, k=k, mode=mode, lane=lane, sd_when_faster=False)
    ids = bench_prompts(tokenizer, prompts, target.config.vocab_size, seed=0)
    rates, ratios = {"off": [], "on": []}, []
    with tempfile.TemporaryDirectory() as tmp:
        for p in ids[:2]:  # warm-up: stages built, lane started
            program.generate(p, max_new_tokens=max_new_tokens, eos_token_id=None, trace=Path(tmp) / "warm.json")
        for rep in range(reps):
            pair = {}
            for kind in (("off", "on") if rep % 2 == 0 else ("on", "off")):
                tokens, wall = 0, 0.0
                for i, p in enumerate([ids[-1]] + ids):  # the first one settles the lane: unmeasured
                    trace = Path(tmp) / f"{rep}-{i}.json" if kind == "on" else None
                    started = time.perf_counter()
                    out = program.generate(p, max_new_tokens=max_new_tokens, eos_token_id=None, trace=trace)
                    if i > 0:
                        wall += time.perf_counter() - started
                        tokens += out.stats["new_tokens"]
                pair[kind] = tokens / wall
                rates[kind].append(pair[kind])
            ratios.append(pair["on"] / pair["off"])
    program.close()
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    return {"mode": mode, "lane": program.lane_kind, "reps": reps, "prompts": prompts,
            "max_new_tokens": max_new_tokens, "tokens_per_s_off": off, "tokens_per_s_on": on,
            "on_over_off": statistics.median(ratios), "samples": rates, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="ssd", choices=["ar", "sd", "ssd"])
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--lane", default="auto", choices=["auto", "thread", "process"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = measure(args.mode, args.reps, args.prompts, args.max_new_tokens, args.k, args.lane)
    print(f"{'mode':<6}{'lane':<9}{'off tok/s':>11}{'on tok/s':>11}{'on/off (median of pairs)':>26}")
    print(f"{result['mode']:<6}{result['lane']:<9}{result['tokens_per_s_off']:>11.1f}"
          f"{result['tokens_per_s_on']:>11.1f}{result['on_over_off']:>26.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
