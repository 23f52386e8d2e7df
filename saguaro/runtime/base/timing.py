"""How long device work took: the one clock of stage costs, calibration and the planner. Off CUDA (and
during CUDA graph capture) the host clock; on CUDA a :class:`Stopwatch`'s two events on one stream, read
lazily. A :class:`LateRead` reads a round's small device value a round late: the device never waits."""

from __future__ import annotations

import time
from collections import deque

import torch


class Interval:
    """Seconds of measured work: host seconds, or two CUDA events on one stream resolved on first read."""

    __slots__ = ("_seconds", "_start", "_end")

    def __init__(self, seconds: float | None = None, start=None, end=None):
        if (seconds is None) == (end is None):
            raise ValueError(
                "an Interval is either host seconds or a pair of CUDA events, not both or neither"
            )
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
        return (
            f"Interval({self._seconds!r})" if self._seconds is not None else "Interval(<pending CUDA events>)"
        )


class Stopwatch:
    """Started on construction; :meth:`stop` returns the :class:`Interval` of the work queued between,
    on ``stream`` (default: ``device``'s current stream) on CUDA."""

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
    """An empty pinned host tensor like ``value``, for ``non_blocking`` device→host copies."""
    return torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=True)


class LateRead:
    """Small device values read on the host a round late: :meth:`post` a round's value once it is queued,
    :meth:`take` the oldest while a newer one is posted (else ``RuntimeError``). On CUDA the value is a
    pinned copy behind an event, so taking it never waits for the device's current work."""

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
        """The oldest posted value as a Python number or list; a newer post must be queued."""
        if len(self._posted) < 2:
            raise RuntimeError(
                "LateRead: a value is taken a round late, once the next round has posted its own"
            )
        host, done = self._posted.popleft()
        if done is not None:
            done.synchronize()  # the older round's copy; the newer round keeps the device busy meanwhile
        return host.tolist()
