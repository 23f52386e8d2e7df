"""Device→host reads counted on the CPU, by round and by lane (``test_host_syncs.py``).

On CUDA a read of a device tensor (``.item()``, ``bool(t)``, ``int(t)``, ``.tolist()``, ``.cpu()``,
``.nonzero()``, a boolean-mask index) waits for the device, and so does synchronizing a CUDA event the
device has not passed yet. On the CPU those calls cost nothing, but they are exactly the ones that sync on
CUDA, so counting them during a generation on the CPU is the honest check of a round's syncs. Each read
is one of two kinds:

- ``sync``: a read of a device tensor, or a wait for an event (a ``Stopwatch``'s, given fake events here:
  :class:`FakeTimeline`) that the device has not passed: the host waits for the device's newest work.
- ``late``: a read inside :meth:`LateRead.take <saguaro.runtime.base.timing.LateRead.take>` (its event's
  wait and its ``tolist``): the pinned copy of a value posted before the newest post, so the device has
  a newer round queued while the host waits, if it waits at all. Not a sync: the device never idles.

With ``cuda_late_reads`` the ``LateRead`` of the caller's thread runs its CUDA branch (pinned buffer:
a plain CPU tensor; events: :class:`FakeEvent`), so the test sees the event and the copy CUDA would use.
Reads by host modules (the fan-out estimator's CPU statistics) are host work, not counted.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from pathlib import Path

import torch

import saguaro
from saguaro.runtime.base import model_runner, timing

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "nonzero")
PACKAGE = Path(saguaro.__file__).parent
# the fan-out estimator's statistics are CPU tensors by construction (device="cpu"), fed host lists:
# its reads are host work, not syncs
HOST_MODULES = (PACKAGE / "runtime" / "draft" / "fan_out.py",)
ROUND_FAMILIES = ("round", "step", "verify", "verify_round")  # a target call of one of these begins a round


class FakeTimeline:
    """The one CUDA stream's order of events, on the CPU: each record takes the next number; a sync read
    passes every event recorded so far, an event's ``synchronize`` passes it and those before it."""

    def __init__(self):
        self.recorded = 0
        self.passed = 0


class FakeEvent:
    """``torch.cuda.Event`` on a :class:`FakeTimeline`; a wait on an event not passed is recorded as a read."""

    def __init__(self, counter: ReadCounter, enable_timing: bool = False):
        self.counter, self.number, self.at = counter, None, None

    def record(self, stream=None) -> None:
        timeline = self.counter.timeline
        timeline.recorded += 1
        self.number, self.at = timeline.recorded, time.perf_counter()

    def query(self) -> bool:
        return self.number is not None and self.number <= self.counter.timeline.passed

    def synchronize(self) -> None:
        if not self.query():
            self.counter.record("event.synchronize")
        timeline = self.counter.timeline
        timeline.passed = max(timeline.passed, self.number)

    def elapsed_time(self, end: FakeEvent) -> float:
        return 1000.0 * (end.at - self.at)


class ReadCounter:
    """Records every device→host read made by Saguaro code while installed: ``(round, kind, lane, what,
    where)``; ``round`` is the round running when it happened (None before the first), ``lane`` is
    ``"target"`` on the installing (caller's) thread and ``"draft"`` on any other."""

    def __init__(self):
        self.round = None
        self.reads: list[tuple] = []
        self.timeline = FakeTimeline()
        self.caller = threading.current_thread()
        self._lock = threading.Lock()

    def install(
        self, monkeypatch, count_rounds: bool = True, cuda_late_reads: bool = True, fake_events: bool = True
    ) -> ReadCounter:
        """Patch the reading functions, the caller's ``Stopwatch`` (fake CUDA events) and, when
        ``count_rounds``, the target's round calls (each begins a round); ``cuda_late_reads``: see above.
        On a real GPU, ``fake_events=False`` (and ``cuda_late_reads=False``) keeps CUDA's own events and
        counts a wait for one the device has not passed."""
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._counted(name, getattr(torch.Tensor, name)))
        monkeypatch.setattr(torch, "nonzero", self._counted("torch.nonzero", torch.nonzero))
        for name in ("__getitem__", "__setitem__"):
            monkeypatch.setattr(torch.Tensor, name, self._masked(name, getattr(torch.Tensor, name)))
        if fake_events:
            monkeypatch.setattr(
                torch.cuda, "Event", lambda enable_timing=False: FakeEvent(self, enable_timing)
            )
            monkeypatch.setattr(timing.Stopwatch, "__init__", self._stopwatch(timing.Stopwatch.__init__))
        else:
            synchronize = torch.cuda.Event.synchronize

            def counted_synchronize(event):
                if not event.query():
                    self.record("event.synchronize")
                return synchronize(event)

            monkeypatch.setattr(torch.cuda.Event, "synchronize", counted_synchronize)
        if cuda_late_reads:
            monkeypatch.setattr(timing.LateRead, "__init__", self._late_read(timing.LateRead.__init__))
            monkeypatch.setattr(timing, "pinned_like", lambda value: torch.empty_like(value, device="cpu"))
        if count_rounds:
            run = model_runner.ModelRunner.run

            def counted_run(runner, stage, *args, **kwargs):
                if stage.model == "target" and stage.family in ROUND_FAMILIES and self._on_caller():
                    self.next_round()
                return run(runner, stage, *args, **kwargs)

            monkeypatch.setattr(model_runner.ModelRunner, "run", counted_run)
        return self

    def next_round(self) -> None:
        self.round = 1 if self.round is None else self.round + 1

    def _on_caller(self) -> bool:
        return threading.current_thread() is self.caller

    def _stopwatch(self, original):
        counter = self

        def init(watch, device, stream=None):
            if not counter._on_caller():
                return original(watch, device, stream)  # a draft lane's: the host clock, as on the CPU
            watch.device, watch.stream = torch.device(device), "the caller's fake CUDA stream"
            watch._start = FakeEvent(counter, True)
            watch._start.record()

        return init

    def _late_read(self, original):
        counter = self

        def init(late, device):
            original(late, device)
            late.cuda = late.cuda or counter._on_caller()  # the CUDA branch, on fake events and buffers

        return init

    def record(self, what: str) -> None:
        frame, late, where = sys._getframe(2), False, None
        while frame is not None:
            late = late or frame.f_code is timing.LateRead.take.__code__
            if where is None and frame.f_code.co_filename.startswith(str(PACKAGE)):
                where = frame  # torch's own Python code on the way: the read belongs to its Saguaro caller
            frame = frame.f_back
        if where is None or Path(where.f_code.co_filename) in HOST_MODULES:
            return
        place = f"{Path(where.f_code.co_filename).relative_to(PACKAGE.parent)}:{where.f_lineno}"
        kind, lane = "late" if late else "sync", "target" if self._on_caller() else "draft"
        with self._lock:
            self.reads.append((self.round, kind, lane, what, place))
        if kind == "sync":
            self.timeline.passed = self.timeline.recorded  # the device has done all its work by then

    def _counted(self, name, original):
        def counted(*args, **kwargs):
            self.record(name)
            return original(*args, **kwargs)

        return counted

    def _masked(self, name, original):
        def indexed(tensor, index, *value):
            parts = index if isinstance(index, tuple) else (index,)
            if any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts):
                self.record(f"{name} with a boolean mask")  # a nonzero inside
            return original(tensor, index, *value)

        return indexed

    def per_round(self, rounds: int, kind: str = "sync", lane: str | None = None) -> list[int]:
        """Reads of ``kind`` (on ``lane``, or any) in each round ``1..rounds``."""
        counts = collections.Counter(r for r, k, ln, _, _ in self.reads if k == kind and lane in (None, ln))
        return [counts.get(r, 0) for r in range(1, rounds + 1)]

    def setup(self) -> int:
        """Reads of any kind before the first round."""
        return sum(1 for r, *_ in self.reads if r is None)

    def where(self) -> str:
        places = collections.Counter((kind, lane, what, where) for _, kind, lane, what, where in self.reads)
        return "\n".join(
            f"  {n:4d} x {kind} {what} on the {lane} lane at {where}"
            for (kind, lane, what, where), n in places.most_common()
        )
