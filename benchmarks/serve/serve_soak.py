"""Soak ``saguaro serve``: mixed load for ``--minutes`` while faults are injected, every answer checked.

Clients send greedy and seeded-sampled requests, streamed and whole, continuously. Every ``--fault-every``
seconds (until the last fifth of the run, so the server is seen recovering) one fault, in turn: a client
that disconnects mid-stream, a malformed body (must get 400), the draft lane's process killed (``--mode
ssd`` with the eager backend: the lane is a child process), a burst of ``max_queue + max_batch + 8``
requests at once (past the queue: some get 429, the rest must be answered exactly). Every greedy answer is
compared with ``generate`` of the target alone (AR, this process). The server's resident memory, open file
descriptors, threads and child processes are read from /proc every 10 s, and once more after the load
(waiting up to 30 s for them to settle). Reports mismatches, lost requests (accepted, HTTP 200, but never
answered to the end), each resource's growth, and the server's exit status after SIGTERM; table and JSON.
Exit status 1 on a mismatch or a lost request.

    python benchmarks/serve/serve_soak.py --minutes 30 --json soak.json     # the default pair
    python benchmarks/serve/serve_soak.py --tiny --minutes 1                 # the tests' tiny pair
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_common import PROMPTS, ServerProcess, add_model_args, children, model_dirs, request, resources

FAULTS = ("disconnect", "malformed", "lane_kill", "burst")
BURST_TOKENS = 8


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument("--minutes", type=float, default=1.0, help="how long the load runs (default 1)")
    p.add_argument(
        "--mode", default="ssd", choices=["ar", "sd", "ssd"], help="the server's mode (default ssd)"
    )
    p.add_argument("--clients", type=int, default=4, help="concurrent clients (default 4)")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each request (default 32)")
    p.add_argument("--fault-every", type=float, default=10.0, help="seconds between faults (default 10)")
    p.add_argument(
        "--sample-every", type=float, default=10.0, help="seconds between resource samples (default 10)"
    )
    p.add_argument("--max-batch", type=int, default=8, help="saguaro serve --max-batch (default 8)")
    p.add_argument("--max-queue", type=int, default=16, help="saguaro serve --max-queue (default 16)")
    return p


def reference_answers(target_dir, draft_dir, budgets, threads=None) -> dict:
    """``{(prompt, max_tokens): (text, completion tokens)}``: the target's own greedy answers (AR, eager)."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    from saguaro.compile import compile as saguaro_compile
    from saguaro.models_io import load_pair

    target, _, tokenizer = load_pair(target_dir, None if target_dir else draft_dir, need_draft=False)
    program = saguaro_compile(target, None, mode="ar", backend="eager")
    eos = program.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or ())
    answers = {}
    for prompt in PROMPTS:
        ids = tokenizer(prompt).input_ids
        longest = (
            program.generate(torch.tensor([ids]), max_new_tokens=max(budgets))
            .sequences[0, len(ids) :]
            .tolist()
        )
        for budget in budgets:  # greedy: a smaller budget's answer is the longer one's beginning
            tokens = longest[:budget]
            end = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
            answers[(prompt, budget)] = (tokenizer.decode(tokens[:end], skip_special_tokens=True), end)
    program.close()
    return answers


class Tally:
    def __init__(self, answers):
        self.answers, self.lock = answers, threading.Lock()
        self.requests, self.statuses, self.checked = 0, {}, 0
        self.mismatches, self.lost, self.errors = [], [], []

    def record(self, body: dict, result: dict) -> None:
        with self.lock:
            self.requests += 1
            self.statuses[str(result["status"])] = self.statuses.get(str(result["status"]), 0) + 1
            if result["accepted"] and result["error"] is not None:
                self.lost.append({"body": body, "error": result["error"]})
            elif result["status"] not in (200, 429) or (result["status"] is None):
                self.errors.append({"body": body, "status": result["status"], "error": result["error"]})
            elif result["status"] == 200 and body.get("temperature") == 0:
                self.checked += 1
                want = self.answers[(body["prompt"], body["max_tokens"])]
                if (result["text"], result["tokens"]) != want:
                    self.mismatches.append({"body": body, "got": result["text"], "want": want[0]})


def client_loop(url, seed, stop_at, args, tally):
    rng = random.Random(seed)
    with httpx.Client() as client:
        while time.perf_counter() < stop_at:
            body = {
                "prompt": rng.choice(PROMPTS),
                "max_tokens": args.max_tokens,
                "stream": rng.random() < 0.5,
                "temperature": 0,
            }
            if rng.random() < 0.25:
                body |= {"temperature": 0.8, "seed": rng.randrange(2**31)}
            tally.record(body, request(client, url, body))


def inject(kind: str, server, args, tally, rng) -> dict:
    """One fault; returns what it did."""
    if kind == "disconnect":
        body = {
            "prompt": rng.choice(PROMPTS),
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "stream": True,
        }
        with (
            httpx.Client() as client,
            client.stream("POST", server.url + "/completions", json=body, timeout=600) as answer,
        ):
            first = next((line for line in answer.iter_lines() if line.startswith("data: ")), None)
        return {"ok": first is not None}
    if kind == "malformed":
        answer = httpx.post(
            server.url + "/completions",
            content=b'{"prompt": "x", "max_tokens": ',
            headers={"content-type": "application/json"},
            timeout=60,
        )
        return {"ok": answer.status_code == 400}
    if kind == "lane_kill":
        killed = children(server.pid)
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        return {"ok": True, "killed": len(killed)}
    results = []  # burst: past the queue at once
    bodies = [
        {"prompt": rng.choice(PROMPTS), "max_tokens": BURST_TOKENS, "temperature": 0}
        for _ in range(args.max_queue + args.max_batch + 8)
    ]

    def one(body):
        with httpx.Client() as client:
            result = request(client, server.url, body)
        tally.record(body, result)
        results.append(result["status"])

    threads = [threading.Thread(target=one, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {
        "ok": all(s in (200, 429) for s in results),
        "refused_429": results.count(429),
        "sent": len(bodies),
    }


def run_soak(args) -> dict:
    began = time.perf_counter()
    target, draft = model_dirs(args)
    answers = reference_answers(target, draft, (args.max_tokens, BURST_TOKENS), args.threads)
    references_s = time.perf_counter() - began
    extra = ("--plan", "always-ssd") if args.mode == "ssd" else ()
    server = ServerProcess(
        target, draft, args.mode, args.backend, args.k, args.max_batch, args.max_queue, args.threads, extra
    )
    tally, samples, faults = Tally(answers), [], []
    try:
        with httpx.Client() as warm:  # every prompt once, checked too
            for prompt in PROMPTS:
                body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
                tally.record(body, request(warm, server.url, body))
        start = time.perf_counter()
        startup_s = start - began - references_s
        baseline = {"t_s": 0.0, **resources(server.pid)}
        samples.append(baseline)
        stop_at = start + 60 * args.minutes
        faults_end = start + 0.8 * 60 * args.minutes
        clients = [
            threading.Thread(target=client_loop, args=(server.url, i, stop_at, args, tally))
            for i in range(args.clients)
        ]
        for t in clients:
            t.start()
        rng, next_fault, next_sample, turn = (
            random.Random(0),
            start + args.fault_every,
            start + args.sample_every,
            0,
        )
        while any(t.is_alive() for t in clients):
            now = time.perf_counter()
            if now >= next_sample:
                samples.append({"t_s": now - start, **resources(server.pid)})
                next_sample = now + args.sample_every
            if now >= next_fault and now < faults_end:
                kind = FAULTS[turn % len(FAULTS)]
                turn += 1
                if kind != "lane_kill" or args.mode == "ssd":
                    faults.append(
                        {"kind": kind, "t_s": now - start, **inject(kind, server, args, tally, rng)}
                    )
                next_fault = time.perf_counter() + args.fault_every
            time.sleep(0.2)
        for t in clients:
            t.join()
        load_s = time.perf_counter() - start
        settle_until = time.perf_counter() + 30
        while True:  # after the load: back to the start?
            final = {"t_s": time.perf_counter() - start, **resources(server.pid)}
            if (
                all(final[k] <= baseline[k] for k in ("fds", "threads", "children"))
                or time.perf_counter() > settle_until
            ):
                break
            time.sleep(1)
        samples.append(final)
        metrics = httpx.get(server.base + "/metrics", timeout=60).text.splitlines()
        server_counts = {
            line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in metrics
            if line.startswith(
                (
                    "saguaro_draft_lane_failures_total",
                    "saguaro_rows_left_early_total",
                    "saguaro_requests_total",
                )
            )
        }
    finally:
        exit_status = server.stop()
    growth = {k: final[k] - baseline[k] for k in ("rss_mib", "fds", "threads", "children")}
    return {
        "minutes": args.minutes,
        "references_s": references_s,
        "startup_s": startup_s,
        "load_s": load_s,
        "settle_s": final["t_s"] - load_s,
        "mode": args.mode,
        "requests": tally.requests,
        "statuses": tally.statuses,
        "greedy_checked": tally.checked,
        "mismatches": len(tally.mismatches),
        "mismatch_examples": tally.mismatches[:3],
        "lost": len(tally.lost),
        "lost_examples": tally.lost[:3],
        "unexpected_errors": len(tally.errors),
        "error_examples": tally.errors[:3],
        "faults": faults,
        "fault_counts": {k: sum(f["kind"] == k for f in faults) for k in FAULTS},
        "faults_failed": sum(not f["ok"] for f in faults),
        "samples": samples,
        "growth": growth,
        "server_counts": server_counts,
        "server_exit": exit_status,
    }


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    report = run_soak(args)
    print(f"{'t (s)':>7} {'RSS MiB':>8} {'fds':>5} {'threads':>7} {'children':>8}")
    for s in report["samples"]:
        print(f"{s['t_s']:>7.0f} {s['rss_mib']:>8.1f} {s['fds']:>5} {s['threads']:>7} {s['children']:>8}")
    print(
        f"{report['requests']} requests in {report['load_s']:.0f} s ({report['statuses']}), "
        f"{report['greedy_checked']} greedy answers checked: {report['mismatches']} mismatches, "
        f"{report['lost']} lost, {report['unexpected_errors']} unexpected errors"
    )
    print(f"faults: {report['fault_counts']} ({report['faults_failed']} did not go as expected)")
    print("growth after the load: " + ", ".join(f"{k} {v:+g}" for k, v in report["growth"].items()))
    print(f"the server's counts: {report['server_counts']}")
    print(f"server exit status after SIGTERM: {report['server_exit']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"report": report, "args": vars(args)}, indent=2, default=str))
    return 1 if report["mismatches"] or report["lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
