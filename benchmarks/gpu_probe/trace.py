"""A ``torch.profiler`` trace of a few decode rounds, and its ``key_averages()`` in the JSON.

The profiler steps at every ``Counters.end_round`` (each mode calls it once per round), on a schedule
that skips one round, warms up on one and records ``ACTIVE`` rounds, of a generation whose shapes have
already run (nothing compiles inside it). The trace is written beside the JSON as
``gpu_probe_trace_<part>.json`` (gzipped past 16 MiB, dropped past that); ``key_averages()`` (the top
operators and kernels, CPU and device totals, the device kernels per round) goes into the JSON itself,
so it survives a trace file that does not come back.
"""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

ACTIVE = 4  # rounds recorded
TRACE_LIMIT = 16 * 2**20  # what the device machine sends back per file
TOP = 15


def _device_us(event, self_time: bool) -> float:
    names = (
        ("self_device_time_total", "self_cuda_time_total")
        if self_time
        else ("device_time_total", "cuda_time_total")
    )
    for name in names:
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def key_averages(prof, rounds: int, cuda: bool) -> dict:
    """The top entries by self device time (CUDA) or self CPU time, and totals per round."""
    averages = prof.key_averages()
    entries = [
        {
            "name": e.key[:120],
            "calls": e.count,
            "self_cpu_ms": round(e.self_cpu_time_total / 1000, 4),
            "self_device_ms": round(_device_us(e, True) / 1000, 4),
        }
        for e in averages
    ]
    key = "self_device_ms" if cuda else "self_cpu_ms"
    entries.sort(key=lambda e: e[key], reverse=True)
    kernels = 0
    if cuda:
        from torch.autograd import DeviceType

        kernels = sum(1 for e in prof.events() if getattr(e, "device_type", None) == DeviceType.CUDA)
    cpu_ms = sum(e.self_cpu_time_total for e in averages) / 1000
    device_ms = sum(_device_us(e, True) for e in averages) / 1000
    per = max(rounds, 1)
    return {
        "sorted_by": key,
        "top": entries[:TOP],
        "cpu_ms_total": round(cpu_ms, 3),
        "device_ms_total": round(device_ms, 3) if cuda else None,
        "cpu_ms_per_round": round(cpu_ms / per, 3),
        "device_ms_per_round": round(device_ms / per, 3) if cuda else None,
        "device_kernels_per_round": round(kernels / per, 1) if cuda else None,
    }


def profile_rounds(program, ids, max_new_tokens: int, out: Path, part: str) -> dict:
    """Trace ``ACTIVE`` rounds of one generation of ``program`` on ``ids``; what it recorded."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from saguaro.runtime.base.stats import Counters

    cuda = ids.device.type == "cuda"
    path = out / f"gpu_probe_trace_{part}.json"
    path.unlink(missing_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    steps = {"n": 0}
    prof = profile(
        activities=activities,
        schedule=schedule(wait=1, warmup=1, active=ACTIVE, repeat=1),
        on_trace_ready=lambda p: p.export_chrome_trace(str(path)),
    )
    real_end = Counters.end_round

    def stepped(self, *args, **kwargs):
        try:
            return real_end(self, *args, **kwargs)
        finally:
            steps["n"] += 1
            prof.step()

    Counters.end_round = stepped
    try:
        with prof:
            program.generate(ids, max_new_tokens=max_new_tokens, eos_token_id=None)
    finally:
        Counters.end_round = real_end
    if cuda:
        torch.cuda.synchronize()
    recorded = min(max(steps["n"] - 2, 0), ACTIVE)
    result = {"rounds": recorded, "generation_rounds": steps["n"]}
    if not path.exists():
        return result | {
            "file": None,
            "note": "no trace written: the generation ran fewer rounds than the schedule needs",
        }
    result["key_averages"] = key_averages(prof, recorded, cuda)
    return result | {"file": _fit(path)}


def _fit(path: Path) -> str | None:
    """The trace's file name, gzipped past the size that comes back; None if it is too big even so."""
    if path.stat().st_size <= TRACE_LIMIT:
        return path.name
    with path.open("rb") as src, gzip.open(f"{path}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()
    gz = Path(f"{path}.gz")
    if gz.stat().st_size > TRACE_LIMIT:
        gz.unlink()
        return None
    return gz.name
