"""Lanes: where a model's stages run. The draft lane works while the target verifies.

``ThreadLane`` runs draft work on one worker thread. On CPU both lanes get one intra-op thread
each for the duration of ``generate`` (two lanes on two cores), restored afterwards; with CUDA the
worker issues its work on its own stream.
"""

from __future__ import annotations

import concurrent.futures
import logging

import torch

from saguaro.errors import SaguaroError

log = logging.getLogger(__name__)


class DraftLaneError(SaguaroError):
    """The draft lane failed (an exception, or no answer within the timeout)."""


class ThreadLane:
    """One worker thread; ``submit`` returns a handle whose ``result`` raises ``DraftLaneError``."""

    def __init__(self, device: torch.device, timeout_s: float = 60.0, threads_per_lane: int | None = 1):
        self.device = device
        self.timeout_s = timeout_s
        self.threads_per_lane = threads_per_lane
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="saguaro-draft")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._saved_threads = None

    def __enter__(self):
        if self.device.type == "cpu" and self.threads_per_lane is not None:
            self._saved_threads = torch.get_num_threads()
            torch.set_num_threads(self.threads_per_lane)
        return self

    def __exit__(self, *exc):
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._saved_threads is not None:
            torch.set_num_threads(self._saved_threads)
        return False

    def _run(self, fn, args):
        with torch.inference_mode():
            if self._stream is None:
                return fn(*args)
            with torch.cuda.stream(self._stream):
                out = fn(*args)
            self._stream.synchronize()
            return out

    def submit(self, fn, *args) -> concurrent.futures.Future:
        return self._pool.submit(self._run, fn, args)

    def result(self, future: concurrent.futures.Future):
        try:
            return future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError as exc:
            raise DraftLaneError(f"draft lane gave no answer within {self.timeout_s:.1f}s") from exc
        except Exception as exc:
            raise DraftLaneError(f"draft lane failed: {type(exc).__name__}: {exc}") from exc
