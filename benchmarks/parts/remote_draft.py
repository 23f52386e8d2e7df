"""SSD with the draft on a draft server (``lane="remote"``) against SD and SSD's thread lane.

Meant for two machines: start ``saguaro draft-server --listen HOST:PORT --secret-file F`` on the
draft's machine and pass ``--address HOST:PORT --secret-file F`` here, on the target's. Without
``--address`` the script starts a draft server on this machine over loopback (127.0.0.1): the two
sides then share this machine's cores, so no speed-up is to be expected here; the figures show what
the lane costs (transport, one more process), not what a second machine gains. On one machine the
cores are split between the two sides (the server gets ``--threads 1``, the remote row's target the
rest): two processes each spinning every core's OpenMP thread slow each other down many times over.

The default pair, greedy, batch 1, ``k=5``; each row runs in its own process (the remote row's
target process talks to the server's process): a warm-up generation, then ``--repeats`` timed
generations over held-out prompts; tokens/s is new tokens ÷ wall time of the timed ones. SSD rows
run SSD's own rounds (``sd_when_faster=False``). Prints a table and writes JSON.

    python benchmarks/parts/remote_draft.py --json remote_draft.json [--backend eager|inductor]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run from a checkout without install
ROWS = {
    "ssd (remote lane)": dict(mode="ssd", lane="remote"),
    "sd": dict(mode="sd"),
    "ssd (thread lane)": dict(mode="ssd", lane="thread"),
}
BOOT = "import sys; from saguaro.cli.main import main; sys.exit(main(sys.argv[1:]))"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default=None, help="a running draft server (default: start one on 127.0.0.1)")
    p.add_argument("--secret-file", default=None, help="the secret shared with the server")
    p.add_argument("--backend", default="eager", choices=["eager", "inductor"])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2, help="timed passes over the prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--json", default="remote_draft.json")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # a row, in its own process
    p.add_argument("--target-threads", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args) -> dict:
    import saguaro
    from saguaro.bench.prompts import bench_prompts

    if args.target_threads is not None and args.worker == "ssd (remote lane)":
        import torch

        torch.set_num_threads(args.target_threads)  # the server on this machine has the other cores
    target, draft, tokenizer = saguaro.default_pair()
    options = dict(ROWS[args.worker], k=5, backend=args.backend, sd_when_faster=False)
    if options.get("lane") == "remote":
        options.update(draft_address=args.address, draft_secret_file=args.secret_file)
        draft = None  # the draft is the server's; this process holds the target only
    program = saguaro.compile(target, draft, **options)
    prompts = bench_prompts(
        tokenizer,
        args.prompts,
        target.config.vocab_size,
        0,
        default_pair=True,
        max_tokens=target.config.max_position_embeddings - args.max_new_tokens,
    )
    program.generate(prompts[0], max_new_tokens=args.max_new_tokens)  # connect, warm up, compile
    tokens, wall, stats = 0, 0.0, []
    for _ in range(args.repeats):
        for ids in prompts:
            started = time.perf_counter()
            out = program.generate(ids, max_new_tokens=args.max_new_tokens)
            wall += time.perf_counter() - started
            tokens += out.stats["new_tokens"]
            stats.append(out.stats)
    program.close()
    mean = lambda key: sum(s.get(key) or 0.0 for s in stats) / len(stats)
    return {
        "row": args.worker,
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "mean_accepted_len": mean("mean_accepted_len"),
        "cache_hit_rate": mean("cache_hit_rate"),
        "lane": stats[-1].get("lane"),
        "lane_failures": sum(s.get("lane_failures") or 0 for s in stats),
    }


def start_server(secret_file: str) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            BOOT,
            "draft-server",
            "--listen",
            f"127.0.0.1:{port}",
            "--secret-file",
            secret_file,
            "--threads",
            "1",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    lines = [server.stdout.readline().strip(), server.stdout.readline().strip()]
    if lines[1] != "ready":
        server.kill()
        raise SystemExit(f"the draft server did not start: {lines}")
    return server, f"127.0.0.1:{port}"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    server = None
    if args.address is None:
        import secrets
        import tempfile

        folder = tempfile.mkdtemp(prefix="saguaro-remote-bench-")
        args.secret_file = os.path.join(folder, "secret")
        with open(os.open(args.secret_file, os.O_CREAT | os.O_WRONLY, 0o600), "w") as f:
            f.write(secrets.token_hex(32))
        server, args.address = start_server(args.secret_file)
    results = []
    try:
        for row in ROWS:
            command = [
                sys.executable,
                __file__,
                "--worker",
                row,
                "--address",
                args.address,
                "--backend",
                args.backend,
                "--prompts",
                str(args.prompts),
                "--repeats",
                str(args.repeats),
                "--max-new-tokens",
                str(args.max_new_tokens),
            ]
            if args.secret_file:
                command += ["--secret-file", args.secret_file]
            if server is not None:
                command += ["--target-threads", str(max(1, (os.cpu_count() or 2) - 1))]
            done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=True)
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    finally:
        if server is not None:
            server.kill()
            server.wait()
    where = "loopback, one machine (both sides share its cores)" if server is not None else args.address
    print(
        f"default pair, {args.backend}, greedy, batch 1, k=5, {args.max_new_tokens} new tokens; draft server: {where}"
    )
    print(f"{'row':<20}{'tokens/s':>10}{'accepted':>10}{'hit rate':>10}{'failures':>10}")
    for r in results:
        print(
            f"{r['row']:<20}{r['tokens_per_s']:>10.1f}{r['mean_accepted_len']:>10.2f}{r['cache_hit_rate']:>10.2f}"
            f"{r['lane_failures']:>10}"
        )
    Path(args.json).write_text(
        json.dumps(
            {"server": where, "backend": args.backend, "rows": results, "cpus": os.cpu_count()}, indent=2
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
