"""The thread lane: the draft server on a worker thread of this process (a CUDA stream of its own on
GPU). Posted methods run on the worker, overlapping the caller; a call waits for them, then runs on
the caller's thread (the worker is idle then). On CPU each lane gets one intra-op thread for the
duration of an SSD ``generate`` (:func:`~saguaro.runtime.lanes.protocol.one_thread_per_lane`).
"""

from __future__ import annotations

import concurrent.futures
import logging

import torch

from saguaro.runtime.draft.server import SpeculationServer
from saguaro.runtime.lanes.protocol import DraftLaneError, Method

log = logging.getLogger(__name__)


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

    def _run(self, method: Method, args: tuple):
        with torch.inference_mode():
            if self._stream is None:
                return method.bound_to(self.server)(*args)
            with torch.cuda.stream(self._stream):
                out = method.bound_to(self.server)(*args)
            self._stream.synchronize()
            return out

    def post(self, method: Method, *args) -> None:
        """Start ``server.method(*args)`` on the worker and return at once."""
        self.settle(raise_errors=True)
        self._posted = self._pool.submit(self._run, method, args)

    def call(self, method: Method, *args, timeout_s: float | None = None):
        """Wait for posted work, then run ``server.method(*args)`` (on this thread: the worker is idle, so
        ``timeout_s`` has nothing to bound)."""
        self.settle(raise_errors=True)
        try:
            return self._run(method, args)
        except Exception as exc:
            raise DraftLaneError(f"draft lane failed in {method.value}: {type(exc).__name__}: {exc}") from exc

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
        part = self.call(Method.TRACE_TAKE)
        return [part] if part is not None else []

    def close(self) -> None:
        self.settle()
        self._pool.shutdown(wait=True, cancel_futures=True)
