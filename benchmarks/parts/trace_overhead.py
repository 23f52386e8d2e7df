"""What tracing costs: tokens/s of the same generations with and without ``trace=``, in adjacent pairs.

    python benchmarks/parts/trace_overhead.py --mode ssd --lane thread --reps 12 --prompts 4 --max-new-tokens 48

Each pair decodes one prompt twice, back to back: once untraced and once traced to a JSON file (which
goes first alternates from pair to pair), on the default pair (one intra-op thread per lane). Pairs are
a fraction of a second apart, so a loaded machine's drift mostly cancels within one; the table shows
the median of the per-pair ratios (traced tokens/s over untraced), its interquartile range, and the
ratio of the totals. Every prompt's shape bucket is compiled and both kinds run once before timing.
The draft lane's last, unneeded build of a generation is waited for by the next call, traced or not
(neither kind waits for it at its end), so each kind inherits the other's about equally. Traced wall
time includes collecting the draft lane's events and writing the file; the table also shows that part
alone (``GenerationTrace.__exit__`` and ``finish``, timed around the calls) per traced generation, next
to a traced generation's mean wall time. ``--json`` writes it all.
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
from saguaro.bench.rows import bench_prompts
from saguaro.runtime.base.trace import GenerationTrace


def timing_calls(cls, names: list[str], spent: list[float]) -> None:
    """Wrap ``cls.<name>`` for each name so each call of a recording trace adds its seconds to ``spent``."""
    for name in names:
        original = getattr(cls, name)

        def timed(*args, _original=original, **kwargs):
            started = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                if args[0].recorder is not None:  # an untraced call's trace does nothing
                    spent.append(time.perf_counter() - started)

        setattr(cls, name, timed)


def measure(mode: str, reps: int, prompts: int, max_new_tokens: int, k: int, lane: str = "auto") -> dict:
    torch.set_num_threads(1)
    target, draft, tokenizer = saguaro.default_pair()
    # sd_when_faster=False: SSD rounds on the lane even where the planner measures SD faster (it may here)
    program = saguaro.compile(target, draft, k=k, mode=mode, lane=lane, sd_when_faster=False)
    ids = bench_prompts(tokenizer, prompts, target.config.vocab_size, seed=0)
    seconds, tokens, ratios = {"off": 0.0, "on": 0.0}, {"off": 0, "on": 0}, []
    collect_s: list[float] = []  # the trace's own work after the rounds: collecting events, writing JSON
    with tempfile.TemporaryDirectory() as tmp:
        for p in ids:  # warm-up: every prompt's shape bucket compiled, the lane started, both kinds run
            for trace in (None, Path(tmp) / "warm.json"):
                program.generate(p, max_new_tokens=max_new_tokens, eos_token_id=None, trace=trace)
        timing_calls(GenerationTrace, ["__exit__", "finish"], collect_s)
        for rep in range(reps):
            for i, p in enumerate(ids):
                rate = {}
                for kind in ("off", "on") if (rep + i) % 2 == 0 else ("on", "off"):  # each prompt both ways
                    trace = Path(tmp) / f"{rep}-{i}.json" if kind == "on" else None
                    started = time.perf_counter()
                    out = program.generate(p, max_new_tokens=max_new_tokens, eos_token_id=None, trace=trace)
                    wall = time.perf_counter() - started
                    seconds[kind] += wall
                    tokens[kind] += out.stats["new_tokens"]
                    rate[kind] = out.stats["new_tokens"] / wall
                ratios.append(rate["on"] / rate["off"])
    program.close()
    traced_calls = reps * len(ids)
    quartiles = statistics.quantiles(ratios, n=4)
    return {
        "mode": mode,
        "lane": program.lane_kind,
        "reps": reps,
        "prompts": prompts,
        "pairs": len(ratios),
        "max_new_tokens": max_new_tokens,
        "tokens_per_s_off": tokens["off"] / seconds["off"],
        "tokens_per_s_on": tokens["on"] / seconds["on"],
        "on_over_off": statistics.median(ratios),
        "on_over_off_q1": quartiles[0],
        "on_over_off_q3": quartiles[2],
        "total_on_over_off": (tokens["on"] / seconds["on"]) / (tokens["off"] / seconds["off"]),
        "collect_and_write_ms_per_generation": 1000 * sum(collect_s) / traced_calls,
        "traced_generation_ms": 1000 * seconds["on"] / traced_calls,
        "ratios": ratios,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="ssd", choices=["ar", "sd", "ssd"])
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--lane", default="auto", choices=["auto", "thread", "process"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = measure(args.mode, args.reps, args.prompts, args.max_new_tokens, args.k, args.lane)
    print(
        f"{'mode':<6}{'lane':<9}{'pairs':>6}{'off tok/s':>11}{'on tok/s':>11}{'on/off median':>15}"
        f"{'IQR':>15}{'totals':>8}{'collect+write ms':>18}{'of ms':>8}"
    )
    print(
        f"{result['mode']:<6}{result['lane']:<9}{result['pairs']:>6}{result['tokens_per_s_off']:>11.1f}"
        f"{result['tokens_per_s_on']:>11.1f}{result['on_over_off']:>15.3f}"
        f"{result['on_over_off_q1']:>8.3f}-{result['on_over_off_q3']:.3f}{result['total_on_over_off']:>8.3f}"
        f"{result['collect_and_write_ms_per_generation']:>18.2f}{result['traced_generation_ms']:>8.1f}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
