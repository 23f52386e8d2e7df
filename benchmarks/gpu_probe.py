"""GPU probe: is Saguaro ready for a GPU? One command, four phases, one JSON (``OUT/gpu_probe.json``).

1. **environment**: versions, the GPU and its compute capability, which ``SaguaroConfig`` options this
   build has (``cuda_graphs``, ``draft_device``, ``attention="flex"``).
2. **exactness** (float32 tiny pairs, batch 1 and batch 3 left-padded): greedy AR, SD, SSD on the thread
   and process lanes and SSD with ``fan_out=0`` equal ``transformers`` ``generate``; sampled runs are
   valid. Sub-phases: ``eager``, ``inductor``, ``inductor_cuda_graphs_flex`` (an option this build lacks
   is recorded as "not available in this build"). On CPU only ``eager`` runs by default.
3. **speed** (inductor, bfloat16 on CUDA): a target of Llama-3.1-8B's widths with a few layers and a
   draft made of its first layer, the target's other layers scaled down until greedy agreement is near
   ``--acceptance``; AR, SD, SSD (``sd_when_faster=False``) and SSD with the planner's SD choice, at
   batch 1 and 8: tokens/s, ms per round, accepted length, hit rate, planned SD.
4. **overlap**: per SSD round, CUDA events around the verify (default stream) and the build (the lane's
   stream): the fraction of the build hidden under the verify, and launch (host) time against GPU
   time per stage; a ``torch.profiler`` trace of three rounds beside the JSON. On CPU only host clocks.

The JSON is rewritten after every phase (and every check of the long ones), so a run stopped by a time
limit still returns what ran; a phase that raises is recorded with its traceback and the probe goes
on. No speed figure is asserted. Exit status 1: an exactness check is false or an exactness sub-phase
failed to run. On CUDA each unit runs in a child process (a CUDA error cannot poison the next one) under
its share of ``--budget-s``.

Usage: ``python benchmarks/gpu_probe.py --out DIR`` (an H200: under 8 minutes from a cold start) or
``python benchmarks/gpu_probe.py --scale tiny --device cpu --out DIR`` (part of ``make test``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # the probe's modules, and saguaro from a checkout without install

from probe_report import PHASES, Report, phase_keys  # noqa: E402 - after the path is set

SUBPHASES = ("eager", "inductor", "inductor_cuda_graphs_flex")
# seconds each unit may take at full scale; time a unit leaves unused goes to the units after it
CAPS = {"environment": 30, "exactness:eager": 70, "exactness:inductor": 90,
        "exactness:inductor_cuda_graphs_flex": 70, "speed": 180}
CPU_DEFAULT = " (on CPU the default is eager only: Inductor's C++ compiles take minutes on a small CPU)"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", choices=["full", "tiny"], default="full", help="speed-phase model widths (default full)")
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument("--out", metavar="DIR", default=os.environ.get("OUT") or "bench_results",
                   help="where gpu_probe.json and the trace go (default $OUT, else bench_results)")
    p.add_argument("--phases", default=",".join(PHASES), help="comma-separated phases to run (default all)")
    p.add_argument("--exactness", default="auto",
                   help=f"comma-separated sub-phases of {', '.join(SUBPHASES)} (default: all on CUDA, eager on CPU)")
    p.add_argument("--pairs", default="auto", help="tiny pairs for exactness: llama,qwen2 (default: both on CUDA, "
                                                   "llama on CPU)")
    p.add_argument("--compiled-pairs", default="llama", help="tiny pairs for the compiled exactness sub-phases "
                                                            "(default llama: compiles are what the budget buys)")
    p.add_argument("--budget-s", type=float, default=None, help="the whole run's seconds (default 450; 300 tiny)")
    p.add_argument("--isolate", choices=["auto", "yes", "no"], default="auto",
                   help="one child process per unit (default: yes on CUDA, no on CPU)")
    p.add_argument("--target-layers", type=int, default=4, help="speed target's layers (default 4)")
    p.add_argument("--k", type=int, default=None, help="speed-phase speculation length (default 5; 3 tiny)")
    p.add_argument("--prompt-len", type=int, default=None, help="speed-phase prompt tokens (default 128; 16 tiny)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="speed-phase new tokens (default 128; 24 tiny)")
    p.add_argument("--acceptance", type=float, default=0.7, help="greedy agreement the draft is tuned to (0.7)")
    p.add_argument("--speed-backend", choices=["auto", "eager", "inductor"], default="auto",
                   help="speed and overlap backend (default: inductor on CUDA, eager on CPU)")
    p.add_argument("--cuda-graphs", action="store_true", help="speed and overlap with cuda_graphs=True, if available")
    p.add_argument("--kernel-dir", metavar="DIR", default=None,
                   help="Inductor's cache folder (default: a fresh one, removed at the end)")
    p.add_argument("--fail-phase", metavar="NAME", default=None,
                   help="for testing: make phase NAME (or exactness:SUB) raise at its start")
    p.add_argument("--unit", default=None, help=argparse.SUPPRESS)  # a child process runs this unit only
    p.add_argument("--unit-deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    tiny = args.scale == "tiny"
    args.k = args.k or (3 if tiny else 5)
    args.prompt_len = args.prompt_len or (16 if tiny else 128)
    args.max_new_tokens = args.max_new_tokens or (24 if tiny else 128)
    args.budget_s = args.budget_s or (300.0 if tiny else 450.0)
    cpu = args.device == "cpu"
    if args.exactness == "auto":
        args.exactness = "eager" if cpu else ",".join(SUBPHASES)
    if args.pairs == "auto":
        args.pairs = "llama" if cpu else "llama,qwen2"
    if args.speed_backend == "auto":
        args.speed_backend = "eager" if cpu else "inductor"
    args.isolate = (not cpu) if args.isolate == "auto" else args.isolate == "yes"
    for name, allowed in (("phases", PHASES), ("exactness", SUBPHASES), ("pairs", ("llama", "qwen2")),
                          ("compiled_pairs", ("llama", "qwen2"))):
        bad = [x for x in getattr(args, name).split(",") if x not in allowed]
        if bad:
            p.error(f"--{name.replace('_', '-')} {','.join(bad)} is not allowed: choose from {', '.join(allowed)}")
    return args


def run_phase(name: str, args, ctx: dict, report: Report, deadline: float) -> None:
    """Run one phase (or exactness sub-phase) in this process; record its result or its traceback."""
    import probe_phases

    keys, started = phase_keys(name), time.time()
    partial = {}

    def record(data: dict) -> None:  # a phase's results so far, written at once
        partial.update(data)
        report.update(keys, {"status": "running", **data})

    log(f"phase {name}: start ({deadline - started:.0f}s left for its unit)")
    record({})
    try:
        if args.fail_phase in (name, name.partition(":")[0]):
            raise RuntimeError(f"phase {name} broken on purpose (--fail-phase {args.fail_phase})")
        data = probe_phases.PHASES[name.partition(":")[0]](name, args, ctx, record, deadline)
        status = data.pop("status", "ok")
        report.update(keys, {**data, "status": status, "seconds": round(time.time() - started, 2)})
    except Exception as exc:  # noqa: BLE001 - recorded; the probe goes on to the next phase
        report.update(keys, {"status": "error", "seconds": round(time.time() - started, 2),
                             "error": {"type": type(exc).__name__, "message": str(exc)[:2000],
                                       "traceback": traceback.format_exc()[-8000:]}})
        status = "error"
    log(f"phase {name}: {status} in {time.time() - started:.1f}s")


def units(args) -> list:
    """``(unit, its phases)`` in order; the speed unit also runs overlap (it reuses speed's program)."""
    wanted = args.phases.split(",")
    out = [("environment", ["environment"])] if "environment" in wanted else []
    if "exactness" in wanted:
        out += [(f"exactness:{sub}", [f"exactness:{sub}"]) for sub in args.exactness.split(",")]
    tail = [p for p in ("speed", "overlap") if p in wanted]
    return out + ([("speed", tail)] if tail else [])


def run_child(unit: str, phases: list, args, report: Report, timeout: float) -> None:
    """Run ``unit`` in a child process of its own process group, killed after ``timeout`` seconds."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *args.argv, "--unit", unit,
           "--unit-deadline", str(time.time() + timeout - 10)]
    proc = subprocess.Popen(cmd, process_group=0)
    try:
        code = proc.wait(timeout=timeout)
        why = None if code == 0 else f"error: its process exited with code {code}"
    except subprocess.TimeoutExpired:
        why = f"error: timed out (its process killed after {timeout:.0f}s of the time budget)"
    finally:
        try:  # the child if still running, and whatever it left in its group (draft process, compile workers)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    phases_now = report.load().get("phases", {})
    for name in phases:
        node = phases_now
        for key in phase_keys(name)[1:]:
            node = node.get(key, {})
        if node.get("status") in (None, "pending", "running") and why:
            report.update(phase_keys(name), {"status": why})


def close(ctx: dict) -> None:
    """Stop the draft lanes of the programs a unit kept for the next phase."""
    program = ctx.pop("speed_program", None)
    if program is not None:
        program.close()


def log(message: str) -> None:
    sys.stdout.write(f"[gpu_probe {time.strftime('%H:%M:%S')}] {message}\n")
    sys.stdout.flush()


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    if args.kernel_dir:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(args.kernel_dir).resolve())
    fresh = None
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:  # a cold start: kernels compiled by this run only
        fresh = os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="saguaro_probe_inductor_")
    os.environ["PYTHONUNBUFFERED"] = "1"  # children print as they go
    report = Report(out / "gpu_probe.json")
    if args.unit is not None:  # a child: one unit, then back to the parent
        ctx = {}
        for name in dict(units(args))[args.unit]:
            run_phase(name, args, ctx, report, args.unit_deadline)
        close(ctx)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no interpreter teardown (CUDA, compile workers) to wait for: the report is written

    import torch  # after TORCHINDUCTOR_CACHE_DIR is set

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device} is not allowed here: CUDA is not available "
                         "(use --device cpu --scale tiny for a CPU run)")
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    report.path.unlink(missing_ok=True)
    report.update(("probe",), {"argv": args.argv, "scale": args.scale, "device": args.device,
                               "budget_s": args.budget_s, "isolate": args.isolate,
                               "kernel_dir": os.environ["TORCHINDUCTOR_CACHE_DIR"],
                               "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started))})
    for phase in PHASES:
        report.update(("phases", phase), {"status": "skipped: not in --phases"}
                      if phase not in args.phases.split(",") else {"status": "pending"})
    if "exactness" in args.phases.split(","):
        for sub in SUBPHASES:
            report.update(phase_keys(f"exactness:{sub}"), {"status": "pending"} if sub in args.exactness.split(",")
                          else {"status": "skipped: not in --exactness" + CPU_DEFAULT * (args.device == "cpu")})
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through run_child's finally
    plan, ctx = units(args), {}
    for i, (unit, phases) in enumerate(plan):
        reserve = sum(CAPS.get(u, 60) for u, _ in plan[i + 1:]) * (args.budget_s / sum(CAPS.values()))
        timeout = started + args.budget_s - time.time() - reserve
        if timeout < 15:
            for name in phases:
                report.update(phase_keys(name), {"status": f"skipped: time budget ({args.budget_s:.0f}s) spent"})
            continue
        if args.isolate:
            run_child(unit, phases, args, report, timeout)
        else:
            unit_deadline = time.time() + timeout
            for name in phases:
                run_phase(name, args, ctx, report, unit_deadline)
    close(ctx)
    final = report.load()
    report.update(("probe",), {"wall_s": round(time.time() - started, 1)})
    from probe_report import table

    sys.stdout.write(table(final) + f"\nreport: {report.path}\n")
    if fresh is not None:
        shutil.rmtree(fresh, ignore_errors=True)
    return 1 if report.load()["summary"]["exactness_all_true"] is False else 0


if __name__ == "__main__":
    sys.exit(main())
