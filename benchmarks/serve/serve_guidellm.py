"""guidellm's fixed-length benchmark against ``saguaro serve``: per mode in ``--modes`` (one server each, on
loopback), guidellm's ``concurrent`` profile at each of ``--streams`` for ``--seconds``, over its synthetic
text data at ``--prompt-tokens`` in and ``--output-tokens`` out (guidellm sends ``ignore_eos: true`` and
``max_tokens``, so every answer is that long), on ``/v1/completions``, streamed. Prints guidellm's own tables
and one line per row (completed and errored requests, output tokens/s, time to first token median/p95,
inter-token latency median); ``--json`` keeps that summary beside guidellm's JSON of each mode.

    python benchmarks/serve/serve_guidellm.py --threads 1 --json bench_results/serve_guidellm.json
    python benchmarks/serve/serve_guidellm.py --tiny --modes sd --streams 1 --seconds 5   # checks the script

guidellm is not in the dev extra (it pins click 8.4); it installs beside it, torch unchanged:

    .venv/bin/uv pip install --python .venv/bin/python --index-strategy unsafe-best-match \\
        $(.venv/bin/python tools/pip_sources.py) "torch==2.13.0" -e ".[dev,serve-bench]"
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_common import PROMPTS, REPO, ServerProcess, add_model_args, fmt, model_dirs, request

DEFAULT_TOKENIZER = REPO / "saguaro" / "assets" / "default" / "target"
INSTALL = (
    ".venv/bin/uv pip install --python .venv/bin/python --index-strategy unsafe-best-match "
    '$(.venv/bin/python tools/pip_sources.py) "torch==2.13.0" -e ".[dev,serve-bench]"'
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    p.add_argument(
        "--modes", default="ar,sd,ssd", help="comma-separated modes, one server each (default ar,sd,ssd)"
    )
    p.add_argument(
        "--streams", default="1,16", help="guidellm's concurrent streams, one row each (default 1,16)"
    )
    p.add_argument("--seconds", type=float, default=20.0, help="how long each row runs (default 20)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="synthetic prompt length (default 64)")
    p.add_argument("--output-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    p.add_argument("--max-batch", type=int, default=32, help="saguaro serve --max-batch (default 32)")
    return p


def guidellm(
    server, tokenizer: str, args, streams: list, out: Path, env: dict
) -> subprocess.CompletedProcess:
    """One ``guidellm run``: the concurrent profile at each of ``streams``, JSON to ``out``."""
    argv = [sys.executable, "-m", "guidellm", "run"]
    argv += [
        "--backend",
        f"kind=openai_http,target={server.base},model={server.model},request_format=/v1/completions",
    ]
    argv += ["--profile", f"kind=concurrent,streams={streams[0]}", "--override", "profile.streams"]
    argv += [",".join(str(s) for s in streams)]
    argv += ["--constraint", f"kind=max_duration,seconds={args.seconds:g}"]
    argv += [
        "--data",
        f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
    ]
    argv += ["--tokenizer", f"kind=huggingface_auto,model={tokenizer}"]
    argv += ["--output", f"kind=json,path={out}", "--disable-console-interactive"]
    return subprocess.run(argv, env=env, capture_output=True, text=True, check=False)


def rows_of(report: dict, mode: str) -> list:
    """One summary row per guidellm benchmark (a streams value) of ``report`` (guidellm's JSON)."""
    rows = []
    for bench in report["benchmarks"]:
        m = bench["metrics"]
        ttft, itl = m["time_to_first_token_ms"]["successful"], m["inter_token_latency_ms"]["successful"]
        rows.append(
            {
                "mode": mode,
                "streams": bench["config"]["strategy"]["streams"],
                "seconds": bench["duration"],
                "completed": m["request_totals"]["successful"],
                "errored": m["request_totals"]["errored"],
                "incomplete": m["request_totals"]["incomplete"],
                "output_tokens_per_s": m["output_tokens_per_second"]["total"]["mean"],
                "ttft_median_ms": ttft["median"] if ttft["count"] else None,
                "ttft_p95_ms": ttft["percentiles"]["p95"] if ttft["count"] else None,
                "itl_median_ms": itl["median"] if itl["count"] else None,
            }
        )
    return rows


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if importlib.util.find_spec("guidellm") is None:
        print(f"guidellm is not installed; install it with:\n  {INSTALL}", file=sys.stderr)
        return 2
    target, draft = model_dirs(args)
    tokenizer = str(target or DEFAULT_TOKENIZER)
    streams = [int(s) for s in args.streams.split(",")]
    work = Path(tempfile.mkdtemp(prefix="saguaro-guidellm-"))
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["HF_DATASETS_CACHE"] = str(work / "datasets")
    rows, reports = [], {}
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        server = ServerProcess(
            target,
            draft,
            mode,
            args.backend,
            args.k,
            args.max_batch,
            max(256, 2 * max(streams)),
            args.threads,
        )
        try:
            with httpx.Client() as warm:  # first use of each stage before the clock starts
                body = {"max_tokens": args.output_tokens, "ignore_eos": True, "temperature": 0}
                for prompt in PROMPTS:
                    request(warm, server.url, {**body, "prompt": prompt})
            out = work / f"guidellm-{mode}.json"
            done = guidellm(server, tokenizer, args, streams, out, env)
            if done.returncode != 0:
                print(done.stdout[-4000:], done.stderr[-4000:], sep="\n", file=sys.stderr)
                raise SystemExit(f"guidellm exited {done.returncode} against mode {mode}")
            tables = done.stdout  # its tables (its log lines go to stderr)
            start = tables.find("Run Summary Info")
            print(f"== guidellm against saguaro serve --mode {mode} ==\n{tables[max(start, 0) :]}")
            reports[mode] = json.loads(out.read_text())
            rows += rows_of(reports[mode], mode)
        finally:
            server.stop()
    print(
        f"{'mode':5} {'streams':>7} {'done':>5} {'errors':>6} {'out tok/s':>10} {'ttft mdn':>9} "
        f"{'ttft p95':>9} {'itl mdn':>8}"
    )
    for r in rows:
        print(
            f"{r['mode']:5} {r['streams']:>7} {r['completed']:>5} {r['errored']:>6} {r['output_tokens_per_s']:>10.1f} "
            f"{fmt(r['ttft_median_ms'], 1, 0):>7}ms {fmt(r['ttft_p95_ms'], 1, 0):>7}ms {fmt(r['itl_median_ms']):>6}ms"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"rows": rows, "args": vars(args), "guidellm": reports}, indent=1, default=str)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
