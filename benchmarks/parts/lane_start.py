"""Time a process lane's start on the default pair: the draft process's start-up until its server is built,
and its close, after one generation warmed the caller.

    python benchmarks/parts/lane_start.py --repeats 3 --json lane_start.json

Prints the seconds of each start and writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3, help="lane starts to time (default 3)")
    p.add_argument("--json", metavar="PATH", help="write the times here")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats} is not allowed: it must be >= 1")

    import saguaro
    from saguaro.runtime.lanes.process import ProcessLane

    target, draft, tokenizer = saguaro.default_pair()
    program = saguaro.compile(
        target, draft, k=4, mode="ssd", lane="process", backend="eager", sd_when_faster=False
    )
    ids = tokenizer("def f(x):", return_tensors="pt").input_ids
    program.generate(ids, max_new_tokens=4)  # the caller's stages built, the lane started once
    program.close()
    times = []
    for i in range(args.repeats):
        started = time.perf_counter()
        ProcessLane(program.remote_draft, program.config, 120.0, 60.0).close()
        times.append(round(time.perf_counter() - started, 3))
        print(f"start {i + 1}/{args.repeats}: {times[-1]:.2f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"lane_start_s": times}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
