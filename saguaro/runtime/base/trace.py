"""Timeline traces: Chrome trace-event JSON (Perfetto, chrome://tracing) of one ``generate`` call.

A :class:`TraceRecorder` collects begin/end slices, counters and instants of one process. Tracing is
off when no recorder exists: the runtime keeps ``recorder = None`` and checks it once per stage call.
Every process stamps its events with ``time.monotonic_ns()`` (``CLOCK_MONOTONIC``, shared by all
processes of one host), so the draft process's events, sent back through the lane, share the caller's
clock. Tracks are named: ``target`` and ``draft`` (the models' stage calls, on the lane that runs
them) and ``host`` (rounds, waits for the draft lane, transport, commits). On CUDA a stage slice
spans the stage's launch on the host; its ``device_ms`` argument is the device's time for it
(:mod:`~saguaro.runtime.base.timing`), read when the events are taken.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

from saguaro.runtime.base.stats import run_label
from saguaro.runtime.base.timing import Interval

TRACKS = ("host", "target", "draft")  # the order tracks are shown in


class TraceRecorder:
    """Events of one process: ``(phase, track, name, monotonic ns, args)`` tuples (picklable)."""

    def __init__(self, process: str = "saguaro"):
        self.pid = os.getpid()
        self.process = process
        self.events: list[tuple] = []

    def begin(self, track: str, name: str, args: dict | None = None) -> None:
        self.events.append(("B", track, name, time.monotonic_ns(), args))

    def end(self, track: str, name: str) -> None:
        self.events.append(("E", track, name, time.monotonic_ns(), None))

    @contextmanager
    def slice(self, track: str, name: str, args: dict | None = None):
        self.begin(track, name, args)
        try:
            yield
        finally:
            self.end(track, name)

    def counter(self, track: str, name: str, **values) -> None:
        """A counter sample (Perfetto draws one counter track per name and value key)."""
        self.events.append(("C", track, name, time.monotonic_ns(), values))

    def instant(self, track: str, name: str, args: dict | None = None) -> None:
        self.events.append(("i", track, name, time.monotonic_ns(), args))

    def take(self) -> dict:
        """This process's events so far (a picklable dict: device timings read as milliseconds) and a
        fresh start."""
        events, self.events = self.events, []
        for event in events:
            args = event[4]
            if args:
                for key, value in args.items():
                    if isinstance(value, Interval):
                        args[key] = 1000.0 * value.seconds
        return {"pid": self.pid, "process": self.process, "events": events}


_OFF = nullcontext()


def traced(recorder: TraceRecorder | None, track: str, name: str, args: dict | None = None):
    """A slice when tracing; a shared no-op context otherwise (for calls a few times per round)."""
    return _OFF if recorder is None else recorder.slice(track, name, args)


def chrome_trace(parts: list[dict], metadata: dict | None = None) -> dict:
    """The trace-event JSON object of the parts (:meth:`TraceRecorder.take` results, any processes).

    Timestamps are whole microseconds since the earliest event (integers: formatting a float costs
    ``json.dumps`` a third of its time); each ``(pid, track)`` is one thread track. A part from another
    host (the remote lane) carries ``clock``: the offset already subtracted from its stamps, measured at
    connect; these go to ``otherData["clock_offsets"]``.
    """
    stamps = [e[3] for part in parts for e in part["events"]]
    origin = min(stamps) if stamps else 0
    out, tids, named = [], {}, set()
    for part in parts:
        pid = part["pid"]
        if pid not in named:  # a thread lane's part shares the caller's pid
            named.add(pid)
            out.append({"ph": "M", "name": "process_name", "ts": 0, "pid": pid, "tid": 0, "args": {"name": part["process"]}})
        for phase, track, name, stamp, args in part["events"]:
            key = (pid, track)
            if key not in tids:
                tids[key] = TRACKS.index(track) + 1 if track in TRACKS else len(TRACKS) + 1 + len(tids)
                for meta, value in (("thread_name", track), ("thread_sort_index", tids[key])):
                    out.append({"ph": "M", "name": meta, "ts": 0, "pid": pid, "tid": tids[key], "args": {"name": value}
                                if meta == "thread_name" else {"sort_index": value}})
            event = {"name": name, "cat": track, "ph": phase, "ts": (stamp - origin) // 1000, "pid": pid,
                     "tid": tids[key]}
            if phase == "i":
                event["s"] = "t"
            if args:
                event["args"] = args
            out.append(event)
    metadata = dict(metadata or {})
    clocks = [part["clock"] for part in parts if part.get("clock")]  # another host's events, shifted
    if clocks:
        metadata["clock_offsets"] = clocks
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": metadata}


def write_trace(path, trace: dict) -> Path:
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(trace))
    return path


class GenerationTrace:
    """Records one ``generate`` call when ``trace`` is a path or True (a context manager).

    ``runners`` (ModelRunners of this process) and ``lane`` get the recorder for the duration; the
    lane (SSD) is also asked to record on its side and to send its events back (a process lane sends
    them with its replies; the last round's build, which no outcome needs, is not waited for).
    :meth:`finish` assembles the trace (with the stats) and writes it when ``trace`` is a path.
    """

    def __init__(self, trace, runners: list, lane=None):
        if trace is not None and trace is not False and not (
                trace is True or isinstance(trace, (str, os.PathLike))):
            raise ValueError(f"trace={trace!r} is not allowed: give a file path, True (keep it in memory) or None")
        self.target = trace
        self.recorder = TraceRecorder("saguaro (caller)") if trace else None
        self.owners = runners + ([lane] if lane is not None else [])
        self.lane = lane
        self.parts: list = []

    def __enter__(self) -> "GenerationTrace":
        if self.recorder is not None:
            for owner in self.owners:
                owner.recorder = self.recorder  # runners: stage slices; a lane: transport slices
            if self.lane is not None:
                self.lane.trace_start()  # no reply to wait for: the lane's next call queues behind it
        return self

    def __exit__(self, *exc) -> None:
        if self.recorder is None:
            return
        for owner in self.owners:
            owner.recorder = None
        remote = []
        if self.lane is not None:
            try:
                remote = self.lane.take_trace()
            except Exception:  # noqa: BLE001 - a failed lane loses its events, not the caller's
                remote = []
        self.parts = [self.recorder.take()] + remote

    def finish(self, stats: dict | None = None) -> dict | None:
        """The trace-event object (None when not tracing), written to the path given."""
        if self.recorder is None:
            return None
        # the mode in words beside the stats: a generation the planner ran as SD says so at the top
        meta = {"mode": run_label(stats), "ran_as": stats.get("ran_as"), "stats": stats} if stats is not None else None
        trace = chrome_trace(self.parts, meta)
        if self.target is not True:
            write_trace(self.target, trace)
        return trace
