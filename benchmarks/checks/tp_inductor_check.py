"""A check by hand, not in ``make test`` (about a minute and a half of Inductor compiles on 2 cores):
``tensor_parallel=2`` plus the draft rank with the inductor backend, greedy AR/SD/SSD on the tests'
tiny Llama, against the unsharded eager program's tokens (which the tests check against
``transformers`` ``generate``). Prints one line per mode and rank.

    python benchmarks/checks/tp_inductor_check.py --json tp_inductor.json
"""

import argparse
import datetime
import json
import os
import socket
import sys
import tempfile
import time

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)  # the checkout
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import saguaro
from tests.models import prompts, tiny_target, truncated_draft


def run(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=3, timeout=datetime.timedelta(seconds=900))
    ids, mask = prompts(2, 6, pad_rows={1: 2})
    target = tiny_target("llama")
    program = saguaro.compile(
        target,
        truncated_draft(target),
        k=4,
        mode="sd",
        backend="inductor",
        tensor_parallel=2,
        fan_out="geometric",
    )
    res = {}
    for mode in ("ar", "sd", "ssd"):
        t = time.perf_counter()
        o = program.generate(ids, attention_mask=mask, max_new_tokens=16, mode=mode)
        res[mode] = (o.sequences, o.stats.get("lane"), o.stats.get("lane_failures"), time.perf_counter() - t)
    torch.save(res, f"{out}/r{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", metavar="PATH", help="write one row per mode and rank as JSON")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp(prefix="saguaro-tp-")
    mp.start_processes(run, args=(port, out), nprocs=3, start_method="spawn", join=True)
    ids, mask = prompts(2, 6, pad_rows={1: 2})
    target = tiny_target("llama")
    ref = saguaro.compile(
        target,
        truncated_draft(target),
        k=4,
        mode="sd",
        backend="eager",
        fan_out="geometric",
        lane="thread",
        sd_when_faster=False,
    )
    rows = []
    print(f"{'mode':<5} {'rank':>4} {'equal':>6} {'lane':>8} {'failures':>8} {'seconds':>8}")
    for mode in ("ar", "sd", "ssd"):
        want = ref.generate(ids, attention_mask=mask, max_new_tokens=16, mode=mode).sequences
        for r in range(3):
            seq, lane, fails, secs = torch.load(f"{out}/r{r}.pt", weights_only=False)[mode]
            rows.append(
                {
                    "mode": mode,
                    "rank": r,
                    "equal": torch.equal(seq, want),
                    "lane": lane,
                    "failures": fails,
                    "seconds": round(secs, 1),
                }
            )
            print(f"{mode:<5} {r:>4} {str(rows[-1]['equal']):>6} {str(lane):>8} {str(fails):>8} {secs:>8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
