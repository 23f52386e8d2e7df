"""Timelines of one ``generate`` call as Chrome trace-event JSON (Perfetto, chrome://tracing): slices,
counters and instants on tracks ``host``, ``target``, ``draft``, stamped with ``time.monotonic_ns()`` (one
clock for a host's processes). Tracing is off while ``recorder`` is None."""

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
        """This process's events so far (a picklable dict, device timings in ms); recording starts afresh."""
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
    """A slice when tracing; a shared no-op context otherwise."""
    return _OFF if recorder is None else recorder.slice(track, name, args)


def chrome_trace(parts: list[dict], metadata: dict | None = None) -> dict:
    """The trace-event object of ``parts`` (:meth:`TraceRecorder.take` results of any processes): integer
    microseconds since the earliest event, a thread track per ``(pid, track)``, and another host's ``clock``
    (its offset, already subtracted) in ``otherData["clock_offsets"]``."""
    stamps = [e[3] for part in parts for e in part["events"]]
    origin = min(stamps) if stamps else 0
    out, tids, named = [], {}, set()
    for part in parts:
        pid = part["pid"]
        if pid not in named:  # a thread lane's part shares the caller's pid
            named.add(pid)
            out.append(
                {
                    "ph": "M",
                    "name": "process_name",
                    "ts": 0,
                    "pid": pid,
                    "tid": 0,
                    "args": {"name": part["process"]},
                }
            )
        for phase, track, name, stamp, args in part["events"]:
            key = (pid, track)
            if key not in tids:
                tids[key] = TRACKS.index(track) + 1 if track in TRACKS else len(TRACKS) + 1 + len(tids)
                for meta, value in (("thread_name", track), ("thread_sort_index", tids[key])):
                    out.append(
                        {
                            "ph": "M",
                            "name": meta,
                            "ts": 0,
                            "pid": pid,
                            "tid": tids[key],
                            "args": {"name": value} if meta == "thread_name" else {"sort_index": value},
                        }
                    )
            event = {
                "name": name,
                "cat": track,
                "ph": phase,
                # integers: json.dumps writes them faster than floats, see
                # docs/measurements/2026-12-07-figures-from-runtime-base-draft-lanes.md
                "ts": (stamp - origin) // 1000,
                "pid": pid,
                "tid": tids[key],
            }
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
    """Records one ``generate`` call when ``trace`` is a path or True (a context manager); ``ValueError``
    for anything else. ``runners`` and ``lane`` get the recorder meanwhile, and the lane records its side
    too; :meth:`finish` assembles the trace with the stats and writes it to the path."""

    def __init__(self, trace, runners: list, lane=None):
        if (
            trace is not None
            and trace is not False
            and not (trace is True or isinstance(trace, (str, os.PathLike)))
        ):
            raise ValueError(
                f"trace={trace!r} is not allowed: give a file path, True (keep it in memory) or None"
            )
        self.target = trace
        self.recorder = TraceRecorder("saguaro (caller)") if trace else None
        self.owners = runners + ([lane] if lane is not None else [])
        self.lane = lane
        self.parts: list = []

    def __enter__(self) -> GenerationTrace:
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
            except Exception:
                remote = []
        self.parts = [self.recorder.take()] + remote

    def finish(self, stats: dict | None = None) -> dict | None:
        """The trace-event object (None when not tracing), written to the path given."""
        if self.recorder is None:
            return None
        # the mode in words beside the stats: a generation the planner ran as SD says so at the top
        meta = (
            {"mode": run_label(stats), "ran_as": stats.get("ran_as"), "stats": stats}
            if stats is not None
            else None
        )
        trace = chrome_trace(self.parts, meta)
        if self.target is not True:
            write_trace(self.target, trace)
        return trace
