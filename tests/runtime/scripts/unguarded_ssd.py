# A user's quick script with no `if __name__ == "__main__":` guard: its top level must run once, even
# though SSD's process lane starts another Python process. Usage: unguarded_ssd.py MARKER [--hold]
# (--hold: after the calls, wait on stdin, so a test can look at the draft process or kill this one).
import json
import sys
import time

import torch

import saguaro
from tests.models import prompts, tiny_target, truncated_draft

with open(sys.argv[1], "a") as marker:
    marker.write("top level ran\n")

torch.set_num_threads(1)
target = tiny_target("llama")
draft = truncated_draft(target)
program = saguaro.compile(
    target, draft, k=3, mode="ssd", lane="process", backend="eager", sd_when_faster=False
)
ids, mask = prompts(2, 8, seed=11, pad_rows={1: 2})
expected = program.generate(
    ids, attention_mask=mask, max_new_tokens=24, eos_token_id=None, mode="ar"
).sequences
for call in range(3):
    started = time.perf_counter()
    out = program.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=None)
    print(
        json.dumps(
            {
                "call": call,
                "seconds": round(time.perf_counter() - started, 3),
                "mode": out.stats["mode"],
                "lane": out.stats["lane"],
                "lane_failures": out.stats["lane_failures"],
                "exact": torch.equal(out.sequences, expected),
            }
        ),
        flush=True,
    )
print(json.dumps({"draft_pid": program.lanes.lane().lane.pid}), flush=True)
if "--hold" in sys.argv:
    sys.stdin.readline()
program.close()
