"""Time to first token on a shared system prompt, prefix cache off against on (``Program.cache_prefixes``).

Each request is a system prompt of ``--system-tokens`` seeded tokens, the same for all, then a user part of
``--user-tokens`` tokens of its own. Requests alternate between the two settings on one compiled program (the
cache is dropped for every "off" request and kept across the "on" ones, whose first one fills it). A request's
time to first token is the wall time of ``generate(max_new_tokens=1)``: the prefill and the first token's
decision. The first token of each request must be the same in both settings (the run stops otherwise).

    python benchmarks/serve/prefix_cache_ttft.py --shape qwen2.5-0.5b --json bench_results/prefix_ttft.json

Prints a table and writes JSON (figures of record: benchmarks/README.md, "Prefix caching").
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

import saguaro
from saguaro.bench.real_size import SHAPES, seeded_pair

log = logging.getLogger("prefix_cache_ttft")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b", help="the seeded pair's shape"
    )
    parser.add_argument("--system-tokens", type=int, default=1000, help="the shared system prompt's tokens")
    parser.add_argument("--user-tokens", type=int, default=24, help="each request's own tokens after it")
    parser.add_argument("--requests", type=int, default=5, help="requests per setting")
    parser.add_argument("--mode", choices=["ar", "sd"], default="sd", help="the program's mode")
    parser.add_argument("--backend", choices=["eager", "inductor"], default="eager")
    parser.add_argument("--json", metavar="PATH", help="write the figures here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.system_tokens < 1 or args.user_tokens < 2 or args.requests < 2:
        parser.error("--system-tokens >= 1, --user-tokens >= 2 and --requests >= 2")

    log.info("building the %s pair and compiling (%s, mode %s)", args.shape, args.backend, args.mode)
    target, draft, _ = seeded_pair(args.shape)
    program = saguaro.compile(target, draft, mode=args.mode, backend=args.backend, sd_when_faster=False)
    vocab = target.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    system = torch.randint(3, vocab, (args.system_tokens,), generator=generator).tolist()
    users = [
        torch.randint(3, vocab, (args.user_tokens,), generator=generator).tolist()
        for _ in range(args.requests)
    ]

    def first_token(prompt: list) -> tuple[float, int, int]:
        started = time.perf_counter()
        out = program.generate(torch.tensor([system + prompt]), max_new_tokens=1, temperature=0.0)
        return time.perf_counter() - started, int(out.sequences[0, -1]), out.stats["prefix_cached_tokens"]

    first_token(users[0][:2])  # warm: every stage built once
    rows = []
    cache = None
    for i, user in enumerate(users):
        for setting in ("off", "on"):
            program.prefix_cache = cache if setting == "on" else None
            if setting == "on" and cache is None:
                program.cache_prefixes(4 * (args.system_tokens + args.user_tokens))
                cache = program.prefix_cache
            seconds, token, reused = first_token(user)
            rows.append({"request": i, "cache": setting, "ttft_s": seconds, "token": token, "reused": reused})
            log.info("request %d, cache %-3s: %.3f s (reused %d tokens)", i, setting, seconds, reused)
    program.prefix_cache = None
    for i in range(args.requests):
        off, on = (r for r in rows if r["request"] == i)
        if off["token"] != on["token"]:
            raise SystemExit(
                f"request {i}: first token {off['token']} without the cache, {on['token']} with it"
            )

    off = [r["ttft_s"] for r in rows if r["cache"] == "off"]
    hits = [r["ttft_s"] for r in rows if r["cache"] == "on" and r["reused"] > 0]
    summary = {
        "shape": args.shape,
        "mode": args.mode,
        "backend": args.backend,
        "system_tokens": args.system_tokens,
        "user_tokens": args.user_tokens,
        "ttft_off_median_s": statistics.median(off),
        "ttft_on_first_s": rows[1]["ttft_s"],
        "ttft_on_hit_median_s": statistics.median(hits) if hits else None,
        "speedup": statistics.median(off) / statistics.median(hits) if hits else None,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "rows": rows,
    }
    print(
        f"\nTime to first token, {args.shape} ({args.mode}, {args.backend}), {args.system_tokens}-token system "
        f"prompt + {args.user_tokens} own tokens, {args.requests} requests a setting"
    )
    print("| prefix cache | TTFT median (s) |")
    print("|---|---|")
    print(f"| off | {summary['ttft_off_median_s']:.3f} |")
    print(f"| on, first request (fills it) | {summary['ttft_on_first_s']:.3f} |")
    if hits:
        print(
            f"| on, later requests (hits) | {summary['ttft_on_hit_median_s']:.3f} ({summary['speedup']:.1f}x) |"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
