"""Lanes: where the draft side of SSD runs while the target verifies on the caller's thread.

Both lanes drive a :class:`~saguaro.runtime.draft_server.SpeculationServer` through the same four
calls (``open``, ``begin``, ``finish``, ``close``):

* :class:`ThreadLane`: a worker thread in this process (a CUDA stream of its own on GPU).
* :class:`saguaro.runtime.process_lane.ProcessLane`: another process, reached through
  ``torch.distributed`` (gloo), for when the draft has its own device or the GIL gets in the way.

On CPU each lane gets one intra-op thread for the duration of an SSD ``generate`` (two lanes on two
cores); the caller's setting is restored afterwards.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from contextlib import contextmanager

import torch

from saguaro.errors import SaguaroError
from saguaro.runtime.draft_server import GenerateSpec, Resolution, SpeculationServer

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
    """The draft server on one worker thread; ``build`` overlaps the caller's verification."""

    kind = "thread"

    def __init__(self, server: SpeculationServer, device: torch.device, timeout_s: float):
        self.server = server
        self.timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="saguaro-draft")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pending = None

    def _on_worker(self, fn, *args):
        with torch.inference_mode():
            if self._stream is None:
                return fn(*args)
            with torch.cuda.stream(self._stream):
                out = fn(*args)
            self._stream.synchronize()
            return out

    def _wait(self, future):
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError as exc:
            raise DraftLaneError(f"draft lane gave no answer within {self.timeout_s:.1f}s") from exc
        except Exception as exc:
            raise DraftLaneError(f"draft lane failed: {type(exc).__name__}: {exc}") from exc

    def open(self, spec: GenerateSpec, first_tokens: torch.Tensor) -> Resolution:
        if self._pending is not None:  # a build the last generation no longer needed
            concurrent.futures.wait([self._pending], timeout=self.timeout_s)
            self._pending = None
        self.server.open(spec)
        return self.server.start(first_tokens)

    def begin(self) -> None:
        self._pending = self._pool.submit(self._on_worker, self.server.build)

    def finish(self, accepted: torch.Tensor, outcome: torch.Tensor, verify_s: float) -> tuple[Resolution, float]:
        """Wait for the cache, then resolve the outcome; returns the resolution and the wait in seconds."""
        started = time.perf_counter()
        self._wait(self._pending)
        waited = time.perf_counter() - started
        try:
            return self.server.resolve(accepted, outcome, verify_s), waited
        except Exception as exc:
            raise DraftLaneError(f"draft lane failed: {type(exc).__name__}: {exc}") from exc

    def settle(self) -> None:
        """Wait for a build the generation no longer needs. Nothing may run on the worker once
        ``generate`` returns: changing torch's thread count while another thread computes crashes."""
        if self._pending is not None:
            concurrent.futures.wait([self._pending], timeout=self.timeout_s)
            self._pending = None

    def close(self) -> None:
        self.settle()
        self._pool.shutdown(wait=True, cancel_futures=True)
