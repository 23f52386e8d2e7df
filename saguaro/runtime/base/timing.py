"""How long work on a device took: the one clock of stage costs, calibration and the planner.

On CPU the work runs while the host waits, so the wall clock (``time.perf_counter``) measures it. On
CUDA the host only queues kernels: a host clock would measure their launches. There a
:class:`Stopwatch` records two CUDA events (``enable_timing=True``) on one stream, by default the
current stream of the device at the moment it starts (so a draft lane's stage is timed on the lane's
stream and the target's on the caller's). The :class:`Interval` it returns is read lazily:
``seconds`` waits for the end event only (``cudaEventSynchronize``: the work queued on that stream
before it, neither the whole device nor other streams) the first time it is read, where the code
already needs the number, and ``ready()`` asks without waiting. Other device types (MPS, ...) are
timed on the host, as CPU, and so is work queued while the current stream is being captured into a
CUDA graph (a timing event may not be recorded then; the capture runs nothing anyway).

A :class:`LateRead` is how a loop reads a value of its device work without a host sync: each round
posts a small device tensor (on CUDA: copied ``non_blocking`` into pinned host memory, then an event
recorded), and the host takes the value of the round before once the next round is queued behind it,
so the device never waits for the host (AR's "rows still active", ``runtime/decode/ar.py``).
"""

from __future__ import annotations

import time
from collections import deque

import torch


class Interval:
    """Seconds of measured work: known at once (host clock) or between two CUDA events on one stream,
    resolved on first read and remembered (the events are dropped then)."""

    __slots__ = ("_seconds", "_start", "_end")

    def __init__(self, seconds: float | None = None, start=None, end=None):
        if (seconds is None) == (end is None):
            raise ValueError("an Interval is either host seconds or a pair of CUDA events, not both or neither")
        self._seconds, self._start, self._end = seconds, start, end

    def ready(self) -> bool:
        """Whether :attr:`seconds` can be read without waiting for the device."""
        return self._seconds is not None or bool(self._end.query())

    @property
    def seconds(self) -> float:
        """The measured seconds; on CUDA the first read waits for the end event (that stream only)."""
        if self._seconds is None:
            self._end.synchronize()
            self._seconds = self._start.elapsed_time(self._end) / 1000.0  # elapsed_time is in ms
            self._start = self._end = None
        return self._seconds

    def __repr__(self) -> str:
        return f"Interval({self._seconds!r})" if self._seconds is not None else "Interval(<pending CUDA events>)"


class Stopwatch:
    """Started on construction; :meth:`stop` returns the :class:`Interval` of the work between.

    On CUDA, ``stream`` (default: the current stream of ``device`` now) is where both events are
    recorded: the interval covers exactly the work queued on that stream in between, as the GPU ran it.
    """

    def __init__(self, device, stream=None):
        self.device = torch.device(device)
        self.stream = None
        if self.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            self.stream = stream if stream is not None else torch.cuda.current_stream(self.device)
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record(self.stream)
        else:
            self._started = time.perf_counter()

    def stop(self) -> Interval:
        if self.stream is None:
            return Interval(time.perf_counter() - self._started)
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.stream)
        return Interval(start=self._start, end=end)


def pinned_like(value: torch.Tensor) -> torch.Tensor:
    """An empty host tensor of ``value``'s shape and dtype in pinned (page-locked) memory, which a
    ``non_blocking`` device→host copy fills without the host waiting."""
    return torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=True)


class LateRead:
    """Small device values read on the host a round late: :meth:`post` a round's value after queueing
    the round; :meth:`take` returns the oldest posted value and may be called only while a newer one is
    posted behind it (else it raises), so on CUDA it waits, if at all, for an event of a round that was
    queued before the device's current work (the device stays busy) and reads the pinned copy that
    event completed: not a host sync of the device's work. On other devices there is nothing to wait
    for: the value itself is held and read (``.tolist()``) when taken."""

    DEPTH = 2  # pinned buffers in turn: the one being filled, the one being read

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self._buffers: list = []  # CUDA: pinned host copies, reused in turn (no allocation per round)
        self._posted: deque = deque()  # (host tensor, its CUDA event or None), oldest first
        self.posts = 0

    def post(self, value: torch.Tensor) -> None:
        if len(self._posted) >= self.DEPTH:
            raise RuntimeError("LateRead: take the oldest value before posting another (its buffer is next)")
        if self.cuda:
            if len(self._buffers) < self.DEPTH:
                self._buffers.append(pinned_like(value))
            host = self._buffers[self.posts % self.DEPTH]
            host.copy_(value, non_blocking=True)  # queued on the current stream, after the round
            done = torch.cuda.Event()
            done.record()
        else:
            host, done = value, None
        self._posted.append((host, done))
        self.posts += 1

    @property
    def pending(self) -> int:
        """How many posted values are not taken yet."""
        return len(self._posted)

    def take(self):
        """The oldest posted value as a Python number or list (``tolist``); a newer post must be queued."""
        if len(self._posted) < 2:
            raise RuntimeError("LateRead: a value is taken a round late, once the next round has posted its own")
        host, done = self._posted.popleft()
        if done is not None:
            done.synchronize()  # the older round's copy; the newer round keeps the device busy meanwhile
        return host.tolist()
