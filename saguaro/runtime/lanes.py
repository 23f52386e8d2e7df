"""Lanes: where the draft side of SSD runs while the target verifies on the caller's thread.

A lane serves a :class:`~saguaro.runtime.draft_server.SpeculationServer` through two generic calls:
``call(method, *args)`` runs a server method and returns its result; ``post(method, *args)`` starts
one and returns at once (the round posts ``build`` so that it overlaps the target's verification).
Both lanes keep the server's calls in order, so a ``call`` after a ``post`` waits for it.

* :class:`ThreadLane`: a worker thread in this process (a CUDA stream of its own on GPU).
* :class:`saguaro.runtime.process_lane.ProcessLane`: another process, reached through
  an anonymous socket pair, for when the draft has its own device or the GIL gets in the way.

On CPU each lane gets one intra-op thread for the duration of an SSD ``generate`` (two lanes on two
cores); the caller's setting is restored afterwards.
"""

from __future__ import annotations

import concurrent.futures
import logging
from contextlib import contextmanager

import torch

from saguaro.core.errors import SaguaroError
from saguaro.runtime.draft_server import SpeculationServer

log = logging.getLogger(__name__)


class DraftLaneError(SaguaroError):
    """The draft lane failed (an exception, a dead process, or no answer within the timeout)."""


@contextmanager
def one_thread_per_lane(device: torch.device):
    """Give the caller's lane one intra-op thread on CPU; restore the setting afterwards."""
    if device.type != "cpu":
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


class ThreadLane:
    """The draft server on one worker thread: posted methods run there, overlapping the caller."""

    kind = "thread"
    recorder = None  # set while a traced generate runs (no transport to record in one process)

    def __init__(self, server: SpeculationServer, device: torch.device, timeout_s: float):
        self.server = server
        self.timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="saguaro-draft")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._posted = None

    def _run(self, method: str, args: tuple):
        with torch.inference_mode():
            if self._stream is None:
                return getattr(self.server, method)(*args)
            with torch.cuda.stream(self._stream):
                out = getattr(self.server, method)(*args)
            self._stream.synchronize()
            return out

    def post(self, method: str, *args) -> None:
        """Start ``server.method(*args)`` on the worker and return at once."""
        self.settle(raise_errors=True)
        self._posted = self._pool.submit(self._run, method, args)

    def call(self, method: str, *args, timeout_s: float | None = None):
        """Wait for posted work, then run ``server.method(*args)`` (on this thread: the worker is idle, so
        ``timeout_s`` has nothing to bound)."""
        self.settle(raise_errors=True)
        try:
            return self._run(method, args)
        except Exception as exc:
            raise DraftLaneError(f"draft lane failed in {method}: {type(exc).__name__}: {exc}") from exc

    def settle(self, raise_errors: bool = False) -> None:
        """Wait for posted work. Nothing may run on the worker once ``generate`` returns: changing
        torch's thread count while another thread computes crashes."""
        posted = self._posted
        if posted is None:
            return
        try:
            # an interrupt here keeps the work posted, so the next call still waits for it: the server
            # never runs on two threads at once
            posted.result(timeout=self.timeout_s)
            self._posted = None
        except concurrent.futures.TimeoutError as exc:
            self._posted = None
            if raise_errors:
                raise DraftLaneError(f"draft lane gave no answer within {self.timeout_s:.1f}s") from exc
        except Exception as exc:
            self._posted = None
            if raise_errors:
                raise DraftLaneError(f"draft lane failed: {type(exc).__name__}: {exc}") from exc

    def take_trace(self) -> list[dict]:
        """The worker's events of a traced generation (it has settled: ``decode_ssd`` waits for the
        last build); recording stops."""
        part = self.call("trace_take")
        return [part] if part is not None else []

    def close(self) -> None:
        self.settle()
        self._pool.shutdown(wait=True, cancel_futures=True)
