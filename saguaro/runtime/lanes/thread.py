"""The thread lane: the draft server on a worker thread of this process, on a CUDA stream of its own on
GPU (on the draft's device, ``draft_device``). Posted methods overlap the caller; a call waits for them
and runs on the caller's thread. Arguments and results cross by :class:`~.streams.StreamHandoff`."""

from __future__ import annotations

import concurrent.futures
import logging

import torch

from saguaro.runtime.draft.server import SpeculationServer
from saguaro.runtime.lanes.protocol import DraftLaneError, Method
from saguaro.runtime.lanes.streams import StreamHandoff, Ticket

log = logging.getLogger(__name__)


class ThreadLane:
    """The draft server on one worker thread: posted methods run there, overlapping the caller."""

    kind = "thread"
    recorder = None  # set while a traced generate runs (no transport to record in one process)

    def __init__(self, server: SpeculationServer, device: torch.device, timeout_s: float):
        self.server = server
        self.timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="saguaro-draft")
        self.handoff = StreamHandoff(device)  # the lane's stream on CUDA, and the hand-offs to it
        self._posted = None

    def _run(self, method: Method, ticket: Ticket):
        with torch.inference_mode():
            return self.handoff.serve(ticket, method.bound_to(self.server))

    def post(self, method: Method, *args) -> None:
        """Start ``server.method(*args)`` on the worker and return at once, once the earlier post is done
        (its failure raises here)."""
        self.settle(raise_errors=True)
        try:
            ticket = self.handoff.send(args)
        except Exception as exc:
            raise DraftLaneError(f"draft lane failed in {method.value}: {type(exc).__name__}: {exc}") from exc
        self._posted = self._pool.submit(self._run, method, ticket)

    def call(self, method: Method, *args, timeout_s: float | None = None):
        """Wait for posted work (the lane's timeout), then run ``server.method(*args)`` on this thread:
        ``timeout_s`` bounds nothing, the worker being idle."""
        self.settle(raise_errors=True)
        try:
            return self.handoff.receive(self._run(method, self.handoff.send(args)))
        except Exception as exc:
            raise DraftLaneError(f"draft lane failed in {method.value}: {type(exc).__name__}: {exc}") from exc

    def settle(self, raise_errors: bool = False) -> None:
        """Wait for posted work: nothing may run on the worker once ``generate`` returns (changing torch's
        thread count while another thread computes crashes)."""
        posted = self._posted
        if posted is None:
            return
        try:
            # an interrupt here keeps the work posted, so the next call still waits for it: the server
            # never runs on two threads at once
            reply = posted.result(timeout=self.timeout_s)
            self._posted = None
            self.handoff.receive(reply)  # the caller's stream is ordered after the posted work too
        except concurrent.futures.TimeoutError as exc:
            self._posted = None
            if raise_errors:
                raise DraftLaneError(f"draft lane gave no answer within {self.timeout_s:.1f}s") from exc
        except Exception as exc:
            self._posted = None
            if raise_errors:
                raise DraftLaneError(f"draft lane failed: {type(exc).__name__}: {exc}") from exc

    def take_trace(self) -> list[dict]:
        """The worker's events of a traced generation; recording stops."""
        part = self.call(Method.TRACE_TAKE)
        return [part] if part is not None else []

    def close(self) -> None:
        self.settle()
        self._pool.shutdown(wait=True, cancel_futures=True)
