"""What a speed row counts besides time: device-to-host reads per round, kernel launches per stage call,
and SSD's fan-out per round.

Host syncs are counted as ``tests/runtime/test_host_syncs.py`` does: the reading functions of
``torch.Tensor`` (``.item()``, ``bool(t)``, ``.tolist()``, ``.cpu()``, a boolean-mask index, ...)
patched for one generation, each read made from Saguaro's code recorded; the rounds are delimited by
``Counters.end_round``, which every mode calls once per round. On CUDA each such read waits for the
device; on a CPU they are the same calls, so the count is the one a GPU run would make.

Launches per stage call are counted from the code Inductor generated for the stage (its output code
file's ``call``: Triton ``.run(...)`` launches, C++ kernels, extern calls such as cuBLAS), or, for the
eager backend, as the aten operators of the stage's graph that are not views (each one kernel).
"""

from __future__ import annotations

import collections
import re
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "nonzero")
LAUNCH = re.compile(
    r"\b(?:triton_\w+|\w+_kernel\w*)\.run\(|^\s*(?:cpp_fused_\w+|kernel_cpp_\w+)\(|"
    r"\bextern_kernels\.\w+\(|\btorch\.ops\.\w+\.\w+(?:\.\w+)?\(|^\s*(?:buf\w+\s*=\s*)?aten\.\w+\.\w+\(",
    re.MULTILINE,
)
MAX_ROUNDS_LISTED = 40


class SyncCounter:
    """Device-to-host reads made by Saguaro's code, per round, while entered."""

    def __init__(self):
        import saguaro

        self.package = str(Path(saguaro.__file__).parent)
        self.round = 0  # reads before the first round ends belong to round 0 (prefill and round 1)
        self.reads: list = []
        self.patches: list = []
        self.late_reads = (
            0  # LateRead.take's reads (tests/runtime/read_counter.py tells them apart the same way)
        )
        self._lock = threading.Lock()

    def __enter__(self):
        import torch

        from saguaro.runtime.base.stats import Counters

        for name in READS:
            self._patch(torch.Tensor, name, self._counted(name, getattr(torch.Tensor, name)))
        self._patch(torch, "nonzero", self._counted("torch.nonzero", torch.nonzero))
        for name in ("__getitem__", "__setitem__"):
            self._patch(torch.Tensor, name, self._masked(name, getattr(torch.Tensor, name)))
        real_end = Counters.end_round
        counter = self

        def end_round(self_, *args, **kwargs):
            counter.round += 1
            return real_end(self_, *args, **kwargs)

        self._patch(Counters, "end_round", end_round)
        return self

    def __exit__(self, *exc):
        for owner, attr, original in reversed(self.patches):
            setattr(owner, attr, original)
        self.patches.clear()

    def _patch(self, owner, attr, fn):
        self.patches.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, fn)

    def _record(self, what: str) -> None:
        from saguaro.runtime.base.timing import LateRead

        frame = sys._getframe(2)
        while frame is not None and not frame.f_code.co_filename.startswith(self.package):
            frame = frame.f_back  # torch's own Python code on the way: the read belongs to its Saguaro caller
        if frame is None or frame.f_code.co_filename.endswith("fan_out.py"):  # host statistics, CPU tensors
            return
        if (
            frame.f_code is LateRead.take.__code__
        ):  # a round-late read of a copy its event has passed: no sync
            self.late_reads += 1
            return
        where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}"
        with self._lock:
            self.reads.append((self.round, what, where))

    def _counted(self, name, original):
        def counted(*args, **kwargs):
            self._record(name)
            return original(*args, **kwargs)

        return counted

    def _masked(self, name, original):
        import torch

        def indexed(tensor, index, *value):
            parts = index if isinstance(index, tuple) else (index,)
            if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
                self._record(f"{name} with a boolean mask")
            return original(tensor, index, *value)

        return indexed

    def summary(self, rounds: int) -> dict:
        """``host_syncs_per_round``: the median over rounds 2..n (round 1 holds the prefill's reads)."""
        counts = collections.Counter(r for r, _, _ in self.reads)
        per_round = [counts.get(r, 0) for r in range(rounds)]
        later = sorted(per_round[1:]) or per_round
        places = collections.Counter((what, where) for _, what, where in self.reads)
        return {
            "host_syncs_per_round": int(later[len(later) // 2]) if later else 0,
            "host_syncs": {
                "max_per_round": max(later, default=0),
                "first_round": per_round[0] if per_round else 0,
                "total": len(self.reads),
                "late_reads": self.late_reads,
                "rounds": rounds,
                "where": [f"{n} x {what} at {where}" for (what, where), n in places.most_common(8)],
            },
        }


def launches_in_code(code: str) -> int:
    """Kernel launches in the ``call`` function of Inductor's output code."""
    lines, inside, indent = [], False, 0
    for line in code.splitlines():
        stripped = line.lstrip()
        if stripped.startswith("def call("):
            inside, indent = True, len(line) - len(stripped)
            continue
        if (
            inside
            and stripped
            and len(line) - len(stripped) <= indent
            and stripped.startswith(("def ", "class "))
        ):
            break
        if inside:
            lines.append(line)
    return len(LAUNCH.findall("\n".join(lines)))


def launches_in_graph(gm) -> int:
    """Operators of a stage graph that are not views or tuple indexing: what the eager backend launches
    per call (each aten operator one kernel, or a few)."""
    import operator

    import torch

    count = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        target = node.target
        if isinstance(target, torch._ops.OpOverload) and any(
            a.alias_info is not None and not a.alias_info.is_write for a in target._schema.returns
        ):
            continue  # a view: no kernel
        count += 1
    return count


def stage_launches(fn) -> tuple[int | None, str, bool]:
    """``(launches per call, how counted, graphed)`` of one built stage."""
    import torch

    inner = getattr(fn, "compiled", None)
    graphed = type(fn).__name__ == "GraphedStage" or type(inner).__name__ == "GraphedStage"
    files = list(getattr(fn, "output_code", None) or [])
    if files:
        total, read = 0, True
        for f in files:
            path = Path(f.get("file") or "")
            if path.is_file():
                total += launches_in_code(path.read_text())
            else:
                total, read = total + len(f.get("kernels", [])), False
        return (
            total,
            "inductor output code" if read else "distinct kernel names (output code file not found)",
            graphed,
        )
    gm = fn if isinstance(fn, torch.fx.GraphModule) else getattr(fn, "gm", None) or getattr(fn, "fn", None)
    if isinstance(gm, torch.fx.GraphModule):
        return launches_in_graph(gm), "aten operators of the stage graph (eager)", graphed
    return None, f"not countable ({type(fn).__name__})", graphed


def program_launches(program) -> dict:
    """``launches_per_stage`` of every stage ``program``'s runners have built (the stages of the modes its
    rows ran: a graphed AR may run the step rather than the round), and how they were counted."""
    counts, how, graphed = {}, set(), []
    for runner in filter(None, (program.target, program.draft)):
        for stage, fn in runner.built_stages.items():
            n, source, is_graphed = stage_launches(fn)
            counts[stage.qualified] = n
            how.add(source)
            if is_graphed:
                graphed.append(stage.qualified)
    return {"launches_per_stage": counts, "launches_source": sorted(how), "graphed_stages": graphed}


@contextmanager
def fan_outs():
    """Yields a list of the fan-out (branches per position) each SSD round's build used (thread lane)."""
    from saguaro.runtime.draft.server import SpeculationServer

    seen: list = []
    original = SpeculationServer._build

    def recorded(self, *args, **kwargs):
        seen.append(list(getattr(self, "fan_out", None) or []))
        return original(self, *args, **kwargs)

    SpeculationServer._build = recorded
    try:
        yield seen
    finally:
        SpeculationServer._build = original


def fan_out_summary(seen: list) -> dict:
    budgets = collections.Counter(sum(f) for f in seen)
    return {
        "fan_out_per_round": seen[:MAX_ROUNDS_LISTED],
        "fan_out_rounds": len(seen),
        "branches_per_round_counts": {str(b): n for b, n in sorted(budgets.items())},
    }
