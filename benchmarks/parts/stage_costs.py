"""Stage costs of the default pair (or any saved pair) on this machine: milliseconds per call of each
stage a round uses, the tree stage at several branch counts ``MQ``, and the SD / SSD round they imply.

Each stage's last call in a real generation is re-timed ``--repeats`` times (a stage rewrites the
same slots, so repeats leave the store as they found it). Prints a table and writes JSON.
Example: ``python benchmarks/parts/stage_costs.py --backend inductor --json stage_costs.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without install


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", choices=["eager", "inductor"], default="inductor")
    p.add_argument("--k", type=int, default=5)
    p.add_argument(
        "--budgets", default="0,6,12,18", help="tree branch budgets MQ to time (default 0,6,12,18)"
    )
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--json", default="stage_costs.json")
    return p.parse_args(argv)


class Recorder:
    """Keeps the last call of each (stage, query width) during generations."""

    def __init__(self):
        from saguaro.runtime.base.model_runner import ModelRunner

        self.cls, self.original, self.calls = ModelRunner, ModelRunner.run, {}
        recorder = self

        def run(runner, stage, store, input_ids, *args, **kwargs):
            key = stage.qualified if stage.family != "tree" else f"{stage.qualified}@MQ={input_ids.shape[1]}"
            recorder.calls[key] = (runner, stage, store, (input_ids, *args), kwargs)
            return recorder.original(runner, stage, store, input_ids, *args, **kwargs)

        ModelRunner.run = run

    def restore(self):
        self.cls.run = self.original


def time_ms(runner, stage, store, args, kwargs, repeats: int) -> float:
    for _ in range(3):
        runner.run(stage, store, *args, **kwargs)
    started = time.perf_counter()
    for _ in range(repeats):
        runner.run(stage, store, *args, **kwargs)
    return 1000 * (time.perf_counter() - started) / repeats


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    import saguaro
    from saguaro.bench.rows import bench_prompts

    target, draft, tokenizer = saguaro.default_pair()
    program = saguaro.compile(target, draft, k=args.k, mode="ssd", backend=args.backend, lane="thread")
    prompt = bench_prompts(tokenizer, 1, target.config.vocab_size, 0)[0]
    budgets = [int(b) for b in args.budgets.split(",")]
    recorder = Recorder()
    try:
        program.generate(prompt, max_new_tokens=64, mode="ar", eos_token_id=None)
        program.generate(prompt, max_new_tokens=64, mode="sd", eos_token_id=None)
        for budget in budgets:  # fan-out "k+1 ints" of one total: a fixed MQ per round
            per = [
                budget // (args.k + 1) + (1 if j < budget % (args.k + 1) else 0) for j in range(args.k + 1)
            ]
            program.reconfigure(fan_out=per).generate(
                prompt, max_new_tokens=64, mode="ssd", eos_token_id=None
            )
        with torch.inference_mode():
            costs = {
                key: time_ms(*call[:3], call[3], call[4], args.repeats)
                for key, call in sorted(recorder.calls.items())
                if "prefill" not in key
            }
    finally:
        recorder.restore()
        program.close()
    k = args.k
    # the verify greedy rounds run: with the commit (the round stage) where the builder offers it
    verify = costs.get("target.verify_round_greedy", costs.get("target.verify_greedy"))
    # greedy drafting calls the chained step where the builder offers it, the plain step otherwise
    step = costs.get("draft.chain_greedy", costs.get("draft.step_greedy"))
    glue = costs["draft.glue"]
    rows = {"sd_round_ms": verify + k * step}
    ar = costs.get("target.round_greedy", costs.get("target.step_greedy"))
    if ar:  # what SD needs to pay: its round against the AR tokens it replaces
        rows["sd_round_in_ar_tokens"] = rows["sd_round_ms"] / ar
        rows["verify_in_ar_tokens"] = verify / ar
        rows["draft_step_in_ar_tokens"] = step / ar
    for key, ms in costs.items():
        if "@MQ=" in key:
            rows[f"ssd_build_ms@{key.split('@')[1]}"] = glue + k * ms
    report = {
        "backend": args.backend,
        "threads": torch.get_num_threads(),
        "k": k,
        "stage_ms": costs,
        "derived_ms": rows,
    }
    width = max(map(len, list(costs) + list(rows)))
    for key, ms in list(costs.items()) + list(rows.items()):
        unit = "x" if key.endswith("_in_ar_tokens") else "ms"
        sys.stdout.write(f"{key:<{width}} {ms:8.2f} {unit}\n")
    Path(args.json).write_text(json.dumps(report, indent=2))
    sys.stdout.write(f"wrote {args.json}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
