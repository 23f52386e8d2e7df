"""The probe's command line: parts, budgets, child processes, the report.

Each part runs under its time budget (``--budget-s``, 380 s each at 8B scale, so a part ends in under 7
minutes on a cold H200, process start included). On CUDA each part runs in a child process of its own
process group (a CUDA error cannot spoil the next part); when its budget is spent the child gets
SIGTERM, then ``--grace-s`` seconds to write what it was doing as terminated, then SIGKILL. What a part
measured is in the JSON already: it is rewritten after every row.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from .report import PARTS, Report, table

REPO = Path(__file__).resolve().parents[2]
BUDGET_S = {"8b": 380.0, "tiny": 120.0}  # per part
GRACE_S = 15.0
CACHE = REPO / ".probe_cache" / "inductor"
GRAPHS = {"default": None, "on": True, "off": False}
SUBPHASES = ("inductor_cuda_graphs", "inductor_cuda_graphs_flex", "inductor", "eager")


class PartTerminated(BaseException):
    """SIGTERM reached a part's process: its time share is spent (not an Exception: rows must not catch it)."""


def parse_args(argv=None):
    from . import __doc__ as doc

    p = argparse.ArgumentParser(
        prog="gpu_probe", description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--part",
        default="all",
        type=str.upper,
        help="a part A-E, several (A,C), or all of them in sequence (default all)",
    )
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    p.add_argument(
        "--scale",
        choices=["auto", "8b", "tiny"],
        default="auto",
        help="speed pair: 8b (Llama-3.1-8B's shape, 32 layers, bf16; the default on CUDA) or tiny (CPU)",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        default=os.environ.get("OUT") or "bench_results",
        help="where gpu_probe.json and the traces go (default $OUT, else bench_results)",
    )
    p.add_argument(
        "--budget-s", type=float, default=None, help="seconds per part (default 380 at 8b, 120 tiny)"
    )
    p.add_argument(
        "--grace-s",
        type=float,
        default=GRACE_S,
        help=f"after SIGTERM, seconds before SIGKILL ({GRACE_S:.0f})",
    )
    p.add_argument(
        "--isolate",
        choices=["auto", "yes", "no"],
        default="auto",
        help="one child process per part (default: yes on CUDA, no on CPU)",
    )
    p.add_argument(
        "--cache-dir",
        metavar="DIR",
        default=None,
        help="Inductor's cache (default .probe_cache/inductor in the repository, git-ignored, so "
        "later parts reuse the compiles of earlier ones)",
    )
    p.add_argument(
        "--target-layers", type=int, default=None, help="target's layers (default 32 at 8b, 4 tiny)"
    )
    p.add_argument("--k", type=int, default=None, help="speculation length (default 5; 3 tiny)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 128; 16 tiny)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="new tokens (default 128; 24 tiny)")
    p.add_argument(
        "--acceptance", type=float, default=0.75, help="greedy agreement the draft is tuned to (0.75)"
    )
    p.add_argument(
        "--backend",
        choices=["auto", "eager", "inductor"],
        default="auto",
        help="speed parts' backend (default: inductor on CUDA, eager on CPU)",
    )
    p.add_argument(
        "--cuda-graphs",
        choices=list(GRAPHS),
        default="default",
        help="parts C and E: the build's default cuda_graphs (what a user gets), on or off; "
        "parts A and B measure both",
    )
    p.add_argument(
        "--exactness",
        default="auto",
        help=f"part D's sub-phases, in order, of {', '.join(SUBPHASES)} "
        "(default: inductor_cuda_graphs,eager on CUDA; eager on CPU)",
    )
    p.add_argument(
        "--pairs", default="llama", help="tiny pairs for eager exactness: llama,qwen2 (default llama)"
    )
    p.add_argument(
        "--compiled-pairs", default="llama", help="tiny pairs for compiled exactness (default llama)"
    )
    p.add_argument("--commit", default=None, help="the commit to record, where the copy has no .git")
    p.add_argument(
        "--fail-part", default=None, type=str.upper, help=argparse.SUPPRESS
    )  # testing: raise at its start
    p.add_argument(
        "--test-hang", action="store_true", help=argparse.SUPPRESS
    )  # testing: stall after the head
    p.add_argument("--unit", default=None, help=argparse.SUPPRESS)  # a child process runs this part only
    p.add_argument("--unit-deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    cpu = args.device == "cpu"
    if args.scale == "auto":
        args.scale = "tiny" if cpu else "8b"
    tiny = args.scale == "tiny"
    from .models import LAYERS

    args.target_layers = args.target_layers or LAYERS[args.scale]
    args.k = args.k or (3 if tiny else 5)
    args.prompt_len = args.prompt_len or (16 if tiny else 128)
    args.max_new_tokens = args.max_new_tokens or (24 if tiny else 128)
    args.budget_s = args.budget_s or BUDGET_S[args.scale]
    args.backend = ("eager" if cpu else "inductor") if args.backend == "auto" else args.backend
    args.cuda_graphs = GRAPHS[args.cuda_graphs]
    args.isolate = (not cpu) if args.isolate == "auto" else args.isolate == "yes"
    if args.exactness == "auto":
        args.exactness = "eager" if cpu else "inductor_cuda_graphs,eager"
    args.parts = list(PARTS) if args.part == "ALL" else args.part.split(",")
    for name, allowed in (
        ("parts", PARTS),
        ("exactness", SUBPHASES),
        ("pairs", ("llama", "qwen2")),
        ("compiled_pairs", ("llama", "qwen2")),
    ):
        value = getattr(args, name)
        bad = [x for x in (value if isinstance(value, list) else value.split(",")) if x not in allowed]
        if bad:
            flag = "part" if name == "parts" else name.replace("_", "-")
            p.error(f"--{flag} {','.join(bad)} is not allowed: choose from {', '.join(allowed)}")
    if not 0.0 < args.acceptance < 1.0:
        p.error(f"--acceptance {args.acceptance} is not allowed: choose a fraction between 0 and 1")
    return args


def log(message: str) -> None:
    sys.stdout.write(f"[gpu_probe {time.strftime('%H:%M:%S')}] {message}\n")
    sys.stdout.flush()


def _hang() -> None:
    log("--test-hang: stalling until SIGTERM")
    time.sleep(3600)


def run_part(name: str, args, report: Report, deadline: float) -> None:
    """Run part ``name`` in this process; record its result, its traceback, or its termination."""
    from . import parts

    keys, started, ctx = ("parts", name), time.time(), {}
    log(f"part {name}: start ({deadline - started:.0f}s)")
    report.update(
        keys,
        {
            "title": parts.TITLES[name],
            "status": "running",
            "budget_s": round(deadline - started),
            "pid": os.getpid(),
        },
    )

    def record(data: dict) -> None:
        report.update(keys, {**data, "status": "running"})

    try:
        if args.fail_part == name:
            raise RuntimeError(f"part {name} broken on purpose (--fail-part {name})")
        data = parts.PARTS[name](args, ctx, record, deadline, _hang if args.test_hang else None)
        status = data.pop("status", "ok")
        report.update(keys, {**data, "status": status, "seconds": round(time.time() - started, 2)})
    except PartTerminated:
        mark_terminated(
            report, name, "terminated: SIGTERM at its time share; what it measured before is kept"
        )
        status = "terminated"
    except Exception as exc:
        report.update(
            keys,
            {
                "status": "error",
                "seconds": round(time.time() - started, 2),
                "error": {
                    "type": type(exc).__name__,
                    "message": str(exc)[:2000],
                    "traceback": traceback.format_exc()[-8000:],
                },
            },
        )
        status = "error"
    else:
        parts.close(ctx)
    log(f"part {name}: {status} in {time.time() - started:.1f}s")


def mark_terminated(report: Report, name: str, why: str) -> None:
    """The part, and its rows and sub-phases still running, marked ``why``."""
    part = report.load().get("parts", {}).get(name, {})
    changes = {"status": why}
    if part.get("rows"):
        changes["rows"] = [
            dict(r, status=why) if r.get("status") in ("running", "pending") else r for r in part["rows"]
        ]
    if part.get("subphases"):
        changes["subphases"] = {
            s: dict(d, status=why) if d.get("status") in ("running", "pending") else d
            for s, d in part["subphases"].items()
        }
    report.update(("parts", name), changes)


def run_child(name: str, args, report: Report, budget: float, cmd: list | None = None) -> None:
    """Part ``name`` in a child process group: SIGTERM when ``budget`` is spent, SIGKILL ``--grace-s`` later.
    ``cmd``: another child command (tests)."""
    cmd = cmd or [
        sys.executable,
        "-m",
        "benchmarks.gpu_probe",
        *args.argv,
        "--unit",
        name,  # run from REPO:
        "--out",
        str(Path(args.out).resolve()),  # the parent's folders, wherever it was started
        "--cache-dir",
        os.environ["TORCHINDUCTOR_CACHE_DIR"],
        "--unit-deadline",
        str(time.time() + budget),
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, process_group=0)
    why = None
    try:
        code = proc.wait(timeout=budget)
        why = None if code == 0 else f"error: its process exited with code {code}"
    except subprocess.TimeoutExpired:
        _signal(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=args.grace_s)
            why = f"terminated: its process stopped after SIGTERM at its time share ({budget:.0f}s)"
        except subprocess.TimeoutExpired:
            why = f"terminated: killed {args.grace_s:.0f}s after SIGTERM at its time share ({budget:.0f}s)"
    finally:  # the child if still running, and what it left in its group (draft process, compile workers)
        _signal(proc, signal.SIGKILL)
        proc.wait()
    status = str(report.load().get("parts", {}).get(name, {}).get("status", "pending"))
    if why and status in ("pending", "running"):
        mark_terminated(report, name, why)


def _signal(proc, sig) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def _terminate(*_):
    raise PartTerminated()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cache_dir or "TORCHINDUCTOR_CACHE_DIR" not in os.environ:  # before torch imports
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(args.cache_dir or CACHE).resolve())
    os.environ["PYTHONUNBUFFERED"] = "1"
    out = Path(args.out)
    report = Report(out / "gpu_probe.json")
    if args.unit is not None:  # a child: one part, then back to the parent
        signal.signal(signal.SIGTERM, _terminate)
        run_part(args.unit, args, report, args.unit_deadline)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no interpreter teardown (CUDA, compile workers) to wait for: the report is written

    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(
            f"--device {args.device} is not allowed here: CUDA is not available "
            "(use --device cpu for a CPU run at --scale tiny)"
        )
    out.mkdir(parents=True, exist_ok=True)
    Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).mkdir(parents=True, exist_ok=True)
    started = time.time()
    report.path.unlink(missing_ok=True)
    wanted = args.parts
    report.update(
        ("probe",),
        {
            "argv": args.argv,
            "scale": args.scale,
            "device": args.device,
            "parts": wanted,
            "budget_s_per_part": args.budget_s,
            "isolate": args.isolate,
            "inductor_cache": os.environ["TORCHINDUCTOR_CACHE_DIR"],
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        },
    )
    for name in wanted:
        report.update(("parts", name), {"status": "pending"})
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through run_child's finally
    for name in wanted:
        if args.isolate:
            run_child(name, args, report, args.budget_s)
        else:
            run_part(name, args, report, time.time() + args.budget_s)
    report.update(("probe",), {"wall_s": round(time.time() - started, 1)})
    sys.stdout.write(table(report.load()) + f"\nreport: {report.path}\n")
    return 1 if report.load()["summary"]["exactness_all_true"] is False else 0
