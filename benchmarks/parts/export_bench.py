"""Export vs compile on the default pair: export time, artifact size, load time, load + first generation
vs a cold compile + first generation, and tokens/s of the loaded program vs the compiled one.

    python benchmarks/parts/export_bench.py --modes ar,sd --json export_bench.json

The compiled side runs in this process with an empty Inductor cache (a temporary TORCHINDUCTOR_CACHE_DIR,
so its compile is cold); the loaded side runs in a fresh Python process, as a user loading the
artifact would. Both run one intra-op thread, greedy, batch 1. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def timed_generations(program, prompts, mode, max_new_tokens):
    """``(first call seconds, tokens/s)``: the first call, then one untimed pass over every prompt (so
    that Inductor's second shape bucket, if any, compiles outside the timing), then a timed pass."""
    started = time.perf_counter()
    program.generate(prompts[0], max_new_tokens=max_new_tokens, mode=mode, eos_token_id=None)
    first = time.perf_counter() - started
    for ids in prompts:
        program.generate(ids, max_new_tokens=max_new_tokens, mode=mode, eos_token_id=None)
    tokens, wall = 0, 0.0
    for ids in prompts:
        out = program.generate(ids, max_new_tokens=max_new_tokens, mode=mode, eos_token_id=None)
        tokens += out.stats["new_tokens"]
        wall += out.stats["wall_s"]
    return first, tokens / wall


def prompts_for(tokenizer, count):
    from saguaro.bench.rows import bench_prompts

    return bench_prompts(tokenizer, count, tokenizer.vocab_size, 0)


def loaded_side(path: str, mode: str, max_new_tokens: int, count: int) -> dict:
    """Run in the fresh process: load, first generation, tokens/s; dynamo counters must stay empty."""
    import torch

    torch.set_num_threads(1)
    started = time.perf_counter()
    from torch._dynamo.utils import counters
    from transformers import AutoTokenizer

    import saguaro

    imported = time.perf_counter() - started
    started = time.perf_counter()
    program = saguaro.load(path)
    load_s = time.perf_counter() - started
    prompts = prompts_for(AutoTokenizer.from_pretrained(program.tokenizer_path), count)
    first, tps = timed_generations(program, prompts, mode, max_new_tokens)
    return {
        "import_s": imported,
        "load_s": load_s,
        "first_generation_s": first,
        "tokens_per_s": tps,
        "dynamo_counters": {k: dict(v) for k, v in counters.items() if v},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--modes", default="ar,sd")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--out", default=None, help="artifact folder (default: a temporary one)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--loaded-side", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    mode = args.modes.split(",")[-1]
    if args.loaded_side:
        print(json.dumps(loaded_side(args.loaded_side, mode, args.max_new_tokens, args.prompts)))
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="saguaro-cold-inductor-")
    import torch

    torch.set_num_threads(1)
    import saguaro

    target, draft, tokenizer = saguaro.default_pair()
    prompts = prompts_for(tokenizer, args.prompts)
    out = Path(args.out or tempfile.mkdtemp(prefix="saguaro-artifact-")) / "program"

    started = time.perf_counter()
    compiled = saguaro.compile(target, draft, k=5, mode=mode, backend="inductor")
    first, compiled_tps = timed_generations(compiled, prompts, mode, args.max_new_tokens)
    cold = time.perf_counter() - started

    started = time.perf_counter()
    exporting = saguaro.compile(target, draft, k=5, mode=mode, backend="inductor")
    capture_s = time.perf_counter() - started
    started = time.perf_counter()
    exporting.export(out, modes=args.modes.split(","), sampling=False, tokenizer=tokenizer, announce=print)
    export_s = time.perf_counter() - started
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())

    done = subprocess.run(
        [
            sys.executable,
            __file__,
            "--loaded-side",
            str(out),
            "--modes",
            args.modes,
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--prompts",
            str(args.prompts),
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        check=True,
    )
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    report = {
        "modes": args.modes,
        "mode_timed": mode,
        "max_new_tokens": args.max_new_tokens,
        "torch": torch.__version__,
        "capture_s": capture_s,
        "export_s": export_s,
        "artifact_mib": size / 2**20,
        "cold_compile_plus_first_generation_s": cold,
        "compiled_first_generation_s": first,
        "compiled_tokens_per_s": compiled_tps,
        "loaded": loaded,
        "load_plus_first_generation_s": loaded["load_s"] + loaded["first_generation_s"],
    }
    report["load_first_vs_cold_compile_first"] = report["load_plus_first_generation_s"] / cold
    for key, value in report.items():
        print(f"{key:40s} {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
