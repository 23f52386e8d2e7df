"""Lane lifecycle checks on the default pair, as a user meets them (issue 14). Prints what it measures.

1. An unguarded script (no ``if __name__ == "__main__":``) making three SSD calls with
   ``lane="process"``: how often its top level ran, and each call's time, mode, lane and failures.
2. Ctrl-C as a terminal sends it (SIGINT to the whole process group) while the process lane starts
   and three times mid-generation, each caught as in a notebook: how soon control returns, and the
   next call's time, mode and exactness; then a Ctrl-C that ends the script, and what is left running.

    python benchmarks/checks/lane_checks.py --json lane_checks.json
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

UNGUARDED = """
import time, saguaro
open("marker.txt", "a").write("top level ran\\n")
target, draft, tok = saguaro.default_pair()
program = saguaro.compile(target, draft, mode="ssd", lane="process")
ids = tok("def fibonacci(n):", return_tensors="pt").input_ids
for call in range(3):
    t = time.perf_counter()
    s = program.generate(ids, max_new_tokens=64).stats
    print(f"call {call}: {time.perf_counter() - t:.2f}s mode={s['mode']} lane={s['lane']} "
          f"lane_failures={s['lane_failures']}", flush=True)
"""

INTERRUPTED = """
import json, time, torch, saguaro
target, draft, tok = saguaro.default_pair()
program = saguaro.compile(target, draft, mode="ssd", lane="process")
ids = tok("def fibonacci(n):", return_tensors="pt").input_ids
ar = program.generate(ids, max_new_tokens=48, eos_token_id=None, mode="ar").sequences
def timed(tag):
    t = time.perf_counter()
    out = program.generate(ids, max_new_tokens=48, eos_token_id=None)
    print(json.dumps({"tag": tag, "s": round(time.perf_counter() - t, 2), "mode": out.stats["mode"],
                      "lane": out.stats["lane"], "exact": torch.equal(out.sequences, ar)}), flush=True)
for tag in ["start-up", "generate 1", "generate 2", "generate 3"]:
    print("go", flush=True)
    try:
        program.generate(ids, max_new_tokens=240, eos_token_id=None)
        print("not-interrupted", flush=True)
    except KeyboardInterrupt:
        print("interrupted", time.perf_counter(), flush=True)
    timed("next call after Ctrl-C during " + tag)
timed("a call with no interrupt before")
print("pid", program.lanes.lane().lane.pid, flush=True)
while True:
    program.generate(ids, max_new_tokens=200, eos_token_id=None)
"""


def run_unguarded(folder: Path) -> dict:
    (folder / "script.py").write_text(UNGUARDED)
    started = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "script.py"],
        cwd=folder,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    print(textwrap.indent(out.stdout.strip(), "  "))
    ran = (folder / "marker.txt").read_text().count("top level ran")
    wall = time.perf_counter() - started
    print(f"  top level ran {ran} time(s); script wall {wall:.1f}s, exit code {out.returncode}")
    return {
        "calls": out.stdout.strip().splitlines(),
        "top_level_runs": ran,
        "wall_s": round(wall, 2),
        "exit_code": out.returncode,
    }


def run_interrupted(folder: Path) -> dict:
    (folder / "interrupted.py").write_text(INTERRUPTED)
    proc = subprocess.Popen(
        [sys.executable, "interrupted.py"],
        cwd=folder,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    result = {"control_back_ms": [], "next_calls": []}
    for delay in (2.0, 0.5, 0.5, 0.5):  # the first lands in the lane's start-up (seconds long)
        while proc.stdout.readline().strip() != "go":
            pass
        time.sleep(delay)
        sent = time.perf_counter()
        os.killpg(proc.pid, signal.SIGINT)
        reply = proc.stdout.readline().split()
        if reply and reply[0] == "interrupted":
            result["control_back_ms"].append(round(1000 * (float(reply[1]) - sent)))
            print(f"  Ctrl-C returned control after {result['control_back_ms'][-1]} ms")
        result["next_calls"].append(json.loads(proc.stdout.readline()))
        print("  " + json.dumps(result["next_calls"][-1]))
    result["next_calls"].append(json.loads(proc.stdout.readline()))
    print("  " + json.dumps(result["next_calls"][-1]))
    pid = int(proc.stdout.readline().split()[1])
    time.sleep(0.5)
    sent = time.perf_counter()
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait()
    result["exit_after_ctrl_c_s"] = round(time.perf_counter() - sent, 2)
    print(f"  a Ctrl-C that ends the script: exited after {result['exit_after_ctrl_c_s']:.2f}s")
    time.sleep(0.5)
    result["draft_process_left"] = Path(f"/proc/{pid}").exists()
    print(f"  draft process {pid} still running: {result['draft_process_left']}")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", metavar="PATH", help="write what was measured as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        print("unguarded script, three SSD calls, lane='process':")
        results = {"unguarded": run_unguarded(Path(tmp))}
        print("Ctrl-C to the process group, caught (as in a notebook):")
        results["interrupted"] = run_interrupted(Path(tmp))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
