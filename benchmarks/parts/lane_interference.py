"""What SSD's two lanes cost each other on this machine: the bound on SSD ÷ SD that no plan can beat.

SSD overlaps the draft lane's build with the target's verify, so on a CPU the cores are split between
the lanes (one intra-op thread each on two cores), while SD gives every core to each call in turn.
This script measures, on the default pair (inductor, greedy, batch 1, k=5):

* ``verify`` with torch's default threads and with one thread, alone;
* ``verify`` on one thread while another process (one thread) runs each background load in a loop:
  a pure-Python spin (no memory traffic: what the other core's mere activity costs) and the draft
  lane's real per-round work (glue and the k tree depths at the planner's largest budget);
* ``draft.step`` with the default threads and one thread, and the draft build on one thread.

From these: an SD round is ``verify(all threads) + k · step(best threads)``; an SSD round can be no
shorter than ``max(verify beside the build, build)``; their ratio bounds SSD ÷ SD from above (times
the tokens per round, which SSD can at most equal on a hit). Prints a table and writes JSON.

    python benchmarks/parts/lane_interference.py --json lane_interference.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run from a checkout without install
K = 5


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=60, help="calls per timing (the median of 5 timings is kept)")
    p.add_argument("--json", default="lane_interference.json")
    p.add_argument("--background", choices=["spin", "build"], help=argparse.SUPPRESS)  # the other process
    return p.parse_args(argv)


def recorded_calls(threads: int) -> dict:
    """``{stage key: (runner, stage, store, args, kwargs)}``: the last call of each stage in an SD and an SSD
    generation of the default pair (tree stages at the planner's largest budget, ``stage_costs.Recorder``'s
    keys)."""
    torch.set_num_threads(threads)
    import saguaro
    from benchmarks.parts.stage_costs import Recorder
    from saguaro.bench.rows import bench_prompts

    target, draft, tokenizer = saguaro.default_pair()
    program = saguaro.compile(target, draft, k=K, mode="ssd", backend="inductor", lane="thread")
    prompt = bench_prompts(tokenizer, 1, target.config.vocab_size, 0)[0]
    recorder = Recorder()
    try:
        program.generate(prompt, max_new_tokens=64, mode="sd", eos_token_id=None)
        budget = program.config.budget  # the whole budget every round: the planner's largest tree
        per = [budget // (K + 1) + (1 if j < budget % (K + 1) else 0) for j in range(K + 1)]
        program.reconfigure(fan_out=per, sd_when_faster=False).generate(
            prompt, max_new_tokens=64, mode="ssd", eos_token_id=None
        )
    finally:
        recorder.restore()
    return recorder.calls


def per_call_ms(fn, calls: int) -> float:
    for _ in range(5):
        fn()
    timings = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        timings.append(1000 * (time.perf_counter() - started) / calls)
    return sorted(timings)[2]


def call_of(calls: dict, key: str):
    runner, stage, store, args, kwargs = calls[key]
    return lambda: runner.run(stage, store, *args, **kwargs)


def build_of(calls: dict):
    """The draft lane's per-round work: the glue, then each tree depth (the last depth's call stands for
    every depth: they differ only in the slots they write)."""
    widest = max(
        (key for key in calls if key.startswith("draft.tree_greedy@MQ=")),
        key=lambda key: int(key.split("=")[1]),
    )
    glue, tree = call_of(calls, "draft.glue"), call_of(calls, widest)

    def build():
        glue()
        for _ in range(K):
            tree()

    return build


def background(kind: str) -> None:
    """The other process: signal readiness on stdout, then loop until killed."""
    if kind == "spin":
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        while True:
            pass
    build = build_of(recorded_calls(1))
    with torch.inference_mode():
        build()
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        while True:
            build()


def beside(kind: str, fn, calls: int) -> float:
    """``fn``'s ms per call on this process while the background ``kind`` loops in another process."""
    proc = subprocess.Popen(
        [sys.executable, __file__, "--background", kind],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the {kind} background process did not start")
        return per_call_ms(fn, calls)
    finally:
        proc.kill()
        proc.wait()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.background:
        background(args.background)
        return 0
    default_threads = torch.get_num_threads()
    calls = recorded_calls(default_threads)
    verify_key = (
        "target.verify_round_greedy" if "target.verify_round_greedy" in calls else "target.verify_greedy"
    )
    verify, step, build = call_of(calls, verify_key), call_of(calls, "draft.step_greedy"), build_of(calls)
    ms = {}
    with torch.inference_mode():
        ms["verify, default threads"] = per_call_ms(verify, args.calls)
        ms["draft step, default threads"] = per_call_ms(step, args.calls)
        torch.set_num_threads(1)
        ms["verify, 1 thread"] = per_call_ms(verify, args.calls)
        ms["draft step, 1 thread"] = per_call_ms(step, args.calls)
        ms["draft build (glue + k depths), 1 thread"] = per_call_ms(build, max(1, args.calls // 5))
        ms["verify, 1 thread, beside a spinning process"] = beside("spin", verify, args.calls)
        ms["verify, 1 thread, beside the draft build"] = beside("build", verify, args.calls)
        torch.set_num_threads(default_threads)
    sd_round = ms["verify, default threads"] + K * min(
        ms["draft step, default threads"], ms["draft step, 1 thread"]
    )
    ssd_round = max(
        ms["verify, 1 thread, beside the draft build"], ms["draft build (glue + k depths), 1 thread"]
    )
    derived = {
        "SD round (verify + k steps)": sd_round,
        "SSD round, at best": ssd_round,
        "SSD / SD bound (equal tokens per round)": sd_round / ssd_round,
    }
    width = max(map(len, list(ms) + list(derived)))
    for key, value in ms.items():
        sys.stdout.write(f"{key:<{width}} {value:8.2f} ms\n")
    for key, value in derived.items():
        sys.stdout.write(f"{key:<{width}} {value:8.2f}{'' if 'bound' in key else ' ms'}\n")
    report = {
        "default_threads": default_threads,
        "k": K,
        "ms": ms,
        "derived": derived,
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__},
    }
    Path(args.json).write_text(json.dumps(report, indent=2))
    sys.stdout.write(f"wrote {args.json}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
