"""Load on ``saguaro serve``: 1, 4, 16 and 32 concurrent clients (``--clients``) for ``--seconds`` each,
against a server on loopback in each of ``--modes`` (ar, sd, ssd), one server per mode. The clients send a
mix: prompts of several lengths, streamed and whole, greedy and seeded sampling (``--sampled`` of them);
``--temperature``/``--top-p`` sample every request with those instead (no seed), and ``--json-schema FILE``
sends every request that schema as ``response_format`` (``json_schema``).
``--repeat N`` runs the modes N times, interleaved (ar, sd, ssd, ar, sd, ...: a fresh server each time, so a
drift of the machine's speed falls on every mode alike), and prints each repetition's ratio to AR and their
median.
Per row: completed requests, output tokens/s (the completion tokens of the requests that ended in the
window, over the window), time to first token p50/p99 (streamed requests), inter-token latency p50/p99
(the gaps between streamed chunks: a round's tokens come together), errors, and the stage calls the server
logged as compiling inside the row (a compile there ruins its figures: a warning says so). Prints a table; ``--json``.

    python benchmarks/serve/serve_load.py                       # the default pair, eager, 30 s a row
    python benchmarks/serve/serve_load.py --tiny --seconds 5    # the tests' tiny pair: checks the script
    python benchmarks/serve/serve_load.py --clients 1,16 --temperature 0.7 --top-p 0.9   # sampled, every request
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_common import PROMPTS, ServerProcess, add_model_args, fmt, model_dirs, percentile, request


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument(
        "--modes", default="ar,sd,ssd", help="comma-separated modes, one server each (default ar,sd,ssd)"
    )
    p.add_argument("--clients", default="1,4,16,32", help="concurrent clients per row (default 1,4,16,32)")
    p.add_argument("--seconds", type=float, default=30.0, help="how long each row runs (default 30)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each request (default 64)")
    p.add_argument(
        "--sampled",
        type=float,
        default=0.25,
        help="share of requests sampled at temperature 0.8 with a seed (default 0.25)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="sample every request at this temperature, unseeded (default: the --sampled mix)",
    )
    p.add_argument("--top-p", type=float, default=None, help="send every request this top_p (default: none)")
    p.add_argument(
        "--json-schema",
        metavar="FILE",
        default=None,
        help="send every request response_format json_schema with the JSON Schema in FILE",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the modes this many times, interleaved, a server each time (default 1)",
    )
    p.add_argument("--max-batch", type=int, default=32, help="saguaro serve --max-batch (default 32)")
    p.add_argument(
        "--plan",
        default="auto",
        choices=["auto", "always-ssd"],
        help="saguaro serve --plan: always-ssd "
        "runs SSD's own rounds where the planner would run SD's (default auto)",
    )
    return p


def fixed_fields(args) -> dict:
    """The fields every request carries from ``--temperature``, ``--top-p`` and ``--json-schema`` (empty: none)."""
    fixed = {}
    if args.temperature is not None:
        fixed["temperature"] = args.temperature
    if args.top_p is not None:
        fixed["top_p"] = args.top_p
    if args.json_schema:
        schema = json.loads(Path(args.json_schema).read_text())
        fixed["response_format"] = {"type": "json_schema", "json_schema": {"name": "load", "schema": schema}}
    return fixed


def client_loop(url, clients_seed, stop_at, max_tokens, sampled, results, lock, fixed=None):
    rng = random.Random(clients_seed)
    with httpx.Client() as client:
        while time.perf_counter() < stop_at:
            body = {
                "prompt": rng.choice(PROMPTS),
                "max_tokens": max_tokens,
                "stream": rng.random() < 0.5,
                "temperature": 0,
            }
            if rng.random() < sampled and "temperature" not in (fixed or {}):
                body |= {"temperature": 0.8, "seed": rng.randrange(2**31)}
            body |= fixed or {}
            result = request(client, url, body)
            result["ended"] = time.perf_counter()
            with lock:
                results.append(result)


def run_row(server, clients: int, seconds: float, max_tokens: int, sampled: float, fixed=None) -> dict:
    results, lock = [], threading.Lock()
    start = time.perf_counter()
    stop_at = start + seconds
    threads = [
        threading.Thread(
            target=client_loop,
            args=(server.url, 1000 * clients + i, stop_at, max_tokens, sampled, results, lock, fixed),
        )
        for i in range(clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = (
        time.perf_counter() - start
    )  # the last requests end after the window: they count, over this time
    done = [r for r in results if r["error"] is None]
    ttft = [r["ttft"] for r in done if r["stream"] and r["ttft"] is not None]
    itl = [gap for r in done for gap in r["itl"]]
    return {
        "clients": clients,
        "completed": len(done),
        "seconds": elapsed,
        "output_tokens_per_s": sum(r["tokens"] for r in done) / elapsed,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "itl_p50_s": percentile(itl, 50),
        "itl_p99_s": percentile(itl, 99),
        "errors": len(results) - len(done),
        "error_examples": [r["error"] for r in results if r["error"]][:3],
    }


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    target, draft = model_dirs(args)
    clients = [int(c) for c in args.clients.split(",")]
    fixed = fixed_fields(args)
    if args.repeat < 1:
        raise SystemExit(f"--repeat {args.repeat} is not allowed: it must be 1 or more")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    rows = []
    for repetition, mode in ((r, m) for r in range(args.repeat) for m in modes):
        server = ServerProcess(
            target,
            draft,
            mode,
            args.backend,
            args.k,
            args.max_batch,
            max(256, 2 * max(clients)),
            args.threads,
            extra=("--plan", args.plan) if mode != "ar" else (),
        )
        try:
            with httpx.Client() as warm:  # every shape a row will use compiles before the clock starts
                for prompt in PROMPTS:
                    body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0} | fixed
                    answer = request(warm, server.url, body)
                    if answer["error"] is not None:  # e.g. a field this server refuses: say so, run nothing
                        raise SystemExit(f"saguaro serve --mode {mode} refused {body}: {answer['error']}")
            for n in clients:
                compiled_before = server.compiles_logged()
                measured = run_row(server, n, args.seconds, args.max_tokens, args.sampled, fixed)
                row = {"mode": mode, "repetition": repetition, **measured}
                row["compiles"] = server.compiles_logged() - compiled_before  # in the timed row: it ruins it
                if row["compiles"]:
                    print(
                        f"warning: {row['compiles']} stage call(s) compiled inside the timed row",
                        file=sys.stderr,
                    )
                rows.append(row)
                print(
                    f"{mode} {n} clients (repetition {repetition + 1} of {args.repeat}): {row['completed']} "
                    f"requests, {row['output_tokens_per_s']:.1f} tok/s",
                    file=sys.stderr,
                )
        finally:
            server.stop()
    header = (
        f"{'mode':5} {'rep':>3} {'clients':>7} {'done':>6} {'out tok/s':>10} {'ttft p50':>9} {'ttft p99':>9} "
        f"{'itl p50':>8} {'itl p99':>8} {'errors':>6} {'compiles':>8}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['mode']:5} {r['repetition'] + 1:>3} {r['clients']:>7} {r['completed']:>6} {r['output_tokens_per_s']:>10.1f} "
            f"{fmt(r['ttft_p50_s'], 1000):>7}ms {fmt(r['ttft_p99_s'], 1000):>7}ms {fmt(r['itl_p50_s'], 1000):>6}ms "
            f"{fmt(r['itl_p99_s'], 1000):>6}ms {r['errors']:>6} {r['compiles']:>8}"
        )
    first = [r for r in rows if r["repetition"] == 0]
    by_mode = {}
    for r in first:
        by_mode.setdefault(r["mode"], {})[r["clients"]] = r["output_tokens_per_s"]
    scaling = {m: v[16] / v[1] for m, v in by_mode.items() if 1 in v and 16 in v and v[1] > 0}
    for mode, ratio in scaling.items():
        print(f"{mode}: 16 clients give {ratio:.2f}x the output tokens/s of 1 (repetition 1)")
    over_ar = ratios_to_ar(rows)
    for (mode, n), ratios in over_ar.items():
        listed = ", ".join(f"{x:.2f}" for x in ratios)
        print(f"{mode} / ar at {n} clients: {listed} (median {statistics.median(ratios):.2f}x)")
    if args.json:
        summary = {
            f"{m}/ar@{n}": {"ratios": v, "median": statistics.median(v)} for (m, n), v in over_ar.items()
        }
        Path(args.json).write_text(
            json.dumps(
                {"rows": rows, "scaling_16_over_1": scaling, "ratios_to_ar": summary, "args": vars(args)},
                indent=2,
            )
        )
    return 0


def ratios_to_ar(rows: list) -> dict:
    """``{(mode, clients): [tok/s over AR's, one per repetition]}`` for every mode but ``ar``, each against AR's
    row of the same repetition and client count (none where AR did not run, or measured 0)."""
    ar = {(r["repetition"], r["clients"]): r["output_tokens_per_s"] for r in rows if r["mode"] == "ar"}
    out = {}
    for r in rows:
        base = ar.get((r["repetition"], r["clients"]))
        if r["mode"] != "ar" and base:
            out.setdefault((r["mode"], r["clients"]), []).append(r["output_tokens_per_s"] / base)
    return out


if __name__ == "__main__":
    sys.exit(main())
