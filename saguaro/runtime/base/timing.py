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
"""

from __future__ import annotations

import time

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
