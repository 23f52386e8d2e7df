"""Part C's overlap: how much of the draft lane's build hides under the target's verify.

For one SSD generation at batch 1 (the part's program, ``sd_when_faster=False``), every
verify (the caller's thread, the default stream), every build (the lane's thread and stream) and every
stage call is timed twice: by the host clock around the call (launch time: what the host spends issuing
it) and, on CUDA, by events recorded on the calling stream before and after (GPU time: from the stream
reaching the first event to it reaching the last). Per round, the build's share inside the verify's
interval is the fraction hidden. On CPU there are no CUDA events: host clocks only, and the report says
so.
"""

from __future__ import annotations

import importlib
import threading
import time

MAX_ROUNDS_LISTED = 40


class Timeline:
    """Times ``ssd.verify_and_commit`` (as "verify"), ``SpeculationServer.build`` and ``ModelRunner.run`` while entered."""

    def __init__(self, cuda: bool):
        self.cuda, self.calls, self.patches = cuda, [], []
        self.main = threading.get_ident()

    def __enter__(self):
        import torch

        from saguaro.runtime.base.model_runner import ModelRunner
        from saguaro.runtime.draft.server import SpeculationServer

        ssd = importlib.import_module("saguaro.runtime.decode.ssd")
        self._patch(
            ssd, "verify_and_commit", lambda a: "verify"
        )  # the verify with its commit (the round stage)
        self._patch(SpeculationServer, "build", lambda a: "build")
        self._patch(ModelRunner, "run", lambda a: a[1].qualified)
        if self.cuda:
            torch.cuda.synchronize()
            self.origin = torch.cuda.Event(enable_timing=True)
            self.origin.record()
            self.origin.synchronize()  # every later event comes after it on any stream
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        for owner, attr, original in reversed(self.patches):
            setattr(owner, attr, original)
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def _patch(self, owner, attr: str, name_of) -> None:
        original = getattr(owner, attr)
        timeline = self

        def timed(*args, **kwargs):
            return timeline.timed(name_of(args), original, *args, **kwargs)

        self.patches.append((owner, attr, original))
        setattr(owner, attr, timed)

    def timed(self, name: str, fn, *args, **kwargs):
        start = end = None
        if self.cuda:
            import torch

            start = torch.cuda.Event(enable_timing=True)
            start.record()  # on the calling thread's current stream: the lane's, inside a build
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            t1 = time.perf_counter()
            if self.cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
            self.calls.append(
                {
                    "name": name,
                    "lane": "caller" if threading.get_ident() == self.main else "lane",
                    "host": (1000 * (t0 - self.t0), 1000 * (t1 - self.t0)),
                    "events": (start, end),
                }
            )

    def intervals(self) -> list:
        """Each call with ``host`` and (CUDA) ``gpu`` intervals in ms from the start."""
        for call in self.calls:
            start, end = call.pop("events")
            try:
                call["gpu"] = (
                    (self.origin.elapsed_time(start), self.origin.elapsed_time(end)) if start else None
                )
            except RuntimeError:  # an event of another device (draft_device): no common clock
                call["gpu"] = None
        return self.calls


def _overlap(a, b) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def rounds(calls: list) -> list:
    """``(verify, build)`` per round. Round i posts its build after verify i-1 has ended (it waited for
    build i-1), and round i+1 starts only once build i is done, so build i is the first to start between
    the end of verify i-1 and the start of verify i+1 (its thread may start it after verify i began)."""
    verifies = sorted((c for c in calls if c["name"] == "verify"), key=lambda c: c["host"][0])
    builds = sorted((c for c in calls if c["name"] == "build"), key=lambda c: c["host"][0])
    out = []
    for i, v in enumerate(verifies):
        lo = verifies[i - 1]["host"][1] if i else float("-inf")
        hi = verifies[i + 1]["host"][0] if i + 1 < len(verifies) else float("inf")
        found = next((b for b in builds if lo <= b["host"][0] < hi), None)
        if found is not None:
            builds.remove(found)
            out.append((v, found))
    return out


def summary(calls: list, cuda: bool) -> dict:
    """Hidden fraction of the build per round, and launch against GPU time per stage."""
    pairs, per_round = rounds(calls), []
    totals = {"host": [0.0, 0.0], "gpu": [0.0, 0.0]}  # [overlap, build]
    for v, b in pairs:
        entry = {}
        for clock in ("host", "gpu") if cuda else ("host",):
            over, span = _overlap(v[clock], b[clock]), b[clock][1] - b[clock][0]
            totals[clock][0] += over
            totals[clock][1] += span
            entry |= {
                f"verify_{clock}_ms": round(v[clock][1] - v[clock][0], 4),
                f"build_{clock}_ms": round(span, 4),
                f"hidden_{clock}": round(over / span, 3) if span else None,
            }
        per_round.append(entry)
    stages = {}
    for c in calls:
        s = stages.setdefault(f"{c['name']} [{c['lane']}]", {"calls": 0, "launch_ms": 0.0, "gpu_ms": 0.0})
        s["calls"] += 1
        s["launch_ms"] += c["host"][1] - c["host"][0]
        if c["gpu"]:
            s["gpu_ms"] += c["gpu"][1] - c["gpu"][0]
    for s in stages.values():
        n = s.pop("calls")
        launch, gpu = s.pop("launch_ms") / n, s.pop("gpu_ms") / n
        s |= {
            "calls": n,
            "launch_ms_mean": round(launch, 4),
            "gpu_ms_mean": round(gpu, 4) if cuda else None,
            "launch_over_gpu": round(launch / gpu, 3) if cuda and gpu > 0 else None,
        }
    share = {clock: round(o / b, 3) if b else None for clock, (o, b) in totals.items()}
    return {
        "rounds": len(pairs),
        "hidden_fraction_host": share["host"],
        "hidden_fraction_gpu": share["gpu"] if cuda else None,
        "per_round": per_round[:MAX_ROUNDS_LISTED],
        "stages": dict(sorted(stages.items())),
    }


def measure(ssd, ids, args) -> dict:
    """The overlap of one SSD generation of ``ssd`` (whose shapes have run) on ``ids``."""
    cuda = ids.device.type == "cuda"
    with Timeline(cuda) as timeline:
        out = ssd.generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=None)
    stats = out.stats
    result = summary(timeline.intervals(), cuda) | {
        "clocks": "CUDA events and host perf_counter" if cuda else "host perf_counter only",
        "tokens_per_s": round(stats["tokens_per_s"], 1),
        "overlap_efficiency": stats.get("overlap_efficiency"),
        "cache_hit_rate": stats.get("cache_hit_rate"),
        "ran": stats.get("mode"),
        "plan": stats.get("plan"),
        "lane_failures": stats.get("lane_failures"),
        "generation_rounds": stats.get("rounds"),
    }
    if not cuda:
        result["cuda_events"] = (
            "CUDA-only: not measured on cpu (no GPU time, launch time is all the host sees)"
        )
    return result
