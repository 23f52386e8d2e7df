"""The scheduler: one thread that owns the Program and serves queued requests a round at a time.

Continuous batching at round granularity in every mode (:mod:`saguaro.serve.continuous`). A request that
arrives while others decode is prefilled alone at the next round boundary and joins the running batch of its
temperature (``runtime.batching.BatchSession``: greedy rows together, sampled rows of one temperature
together, each with its own generator); a row whose request ended (its ``max_tokens``, EOS, a stop string, its
client gone) leaves before the next round. At most ``max_batch`` rows run at once, over all temperatures; the
others wait in the queue, in arrival order.

Mode ``ssd``: the draft lane's server takes and drops rows between rounds as the session does
(``runtime/batching_ssd.py``). A request sampled with a seed is planned as ``generate`` plans it alone
(:mod:`saguaro.serve.alone`): SSD's draft lane draws its randomness from one generator per batch, so planned
SSD it runs alone; planned SD it joins a batch of seeded rows running SD's rounds, a generator per row.

Either way each request gets what the same request gets alone through ``program.generate``: greedy token
for token, a seeded sampled request the same tokens (the tests check both against ``generate`` alone).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from saguaro.serve.requests import RequestError, Sampling

log = logging.getLogger(__name__)


class Job:
    """One request in the scheduler. ``deliver(event)`` is called on the scheduler's thread with
    ``("tokens", [ids])``, ``("done", finish_reason)`` or ``("error", message)``; the reader sets
    ``leave`` (a reason) to free the row at the next round."""

    def __init__(self, sampling: Sampling, deliver):
        self.sampling, self.deliver = sampling, deliver
        self.tokens: list = []
        self.leave: str | None = None
        self.arrived = time.perf_counter()
        self.first_token_s: float | None = None
        self.done = False

    def send(self, event) -> None:
        try:
            self.deliver(event)
        except RuntimeError:  # the event loop has closed (the server is gone): nobody is reading
            self.leave = self.leave or "server closed"

    def take(self, new: list, finished: bool, now: float, metrics, eos: set) -> bool:
        """Hand out the row's ``new`` tokens (cut at ``max_tokens``); send ``done`` when the row ``finished``
        or the budget is reached. Returns whether the job is done."""
        new = new[:self.sampling.max_tokens - len(self.tokens)]
        if new:
            if self.first_token_s is None:
                self.first_token_s = now - self.arrived
                metrics.first_token(self.first_token_s)
            self.tokens += new
            self.send(("tokens", new))
        if len(self.tokens) >= self.sampling.max_tokens or finished:
            self.done = True
            self.send(("done", "stop" if self.tokens and self.tokens[-1] in eos else "length"))
        return self.done

    def fail(self, exc: Exception) -> None:
        if not self.done:
            self.done = True
            self.send(("error", f"generation failed: {exc}"))


def eos_set(eos_token_id) -> set:
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(t) for t in eos_token_id}


class Scheduler:
    """Queue at most ``max_queue`` waiting requests (:meth:`submit` refuses more with 429) and decode at most
    ``max_batch`` rows at once on one thread; :meth:`stop` finishes what was accepted, then ends."""

    def __init__(self, program, metrics, max_batch: int = 8, max_queue: int = 64):
        self.program, self.metrics = program, metrics
        self.max_batch, self.max_queue = max_batch, max_queue
        self.eos = eos_set(program.eos_token_id)
        self.waiting: deque = deque()
        self.running = 0  # rows decoding now
        self.closing = False
        self._lane_failures_seen = self.lane_failures
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name="saguaro-serve-scheduler", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, job: Job) -> None:
        with self.cond:
            if self.closing:
                raise RequestError("the server is shutting down and takes no new requests", None, 503, "unavailable")
            if len(self.waiting) >= self.max_queue:
                raise RequestError(f"the queue is full ({self.max_queue} requests waiting, --max-queue); retry later",
                                   None, 429, "rate_limit_exceeded")
            self.waiting.append(job)
            self.cond.notify_all()

    @property
    def lane_failures(self) -> int:
        """Draft lanes dropped after a failure so far (the runtime finished their rounds with SD)."""
        lanes = getattr(self.program, "lanes", None)
        return lanes.failed_lanes if lanes is not None else 0

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    def stop(self, timeout: float | None = None) -> None:
        """Take no more requests; serve those accepted, then end the thread."""
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        if self.thread.ident is not None:
            self.thread.join(timeout)

    def wait_for_work(self, busy: bool) -> bool:
        """Under the lock: wait until a request waits, unless ``busy`` (rows are decoding). False once the
        scheduler is closing with nothing waiting and nothing running: the loop ends."""
        while not self.waiting and not busy and not self.closing:
            self.cond.wait()
        return bool(self.waiting) or busy

    def take_waiting(self, most: int) -> list:
        """Under the lock: up to ``most`` waiting requests in arrival order (dropping those whose client left)."""
        for job in [j for j in self.waiting if j.leave]:
            self.waiting.remove(job)
        return [self.waiting.popleft() for _ in range(min(most, len(self.waiting)))]

    def check_lane(self, rows: int) -> None:
        if self.lane_failures > self._lane_failures_seen:
            self._lane_failures_seen = self.lane_failures
            log.warning("the draft lane failed during a batch of %d request(s); its rounds finished exactly with SD "
                        "(the next SSD batch starts a new lane) and the server keeps serving", rows)

    def _loop(self) -> None:
        from saguaro.serve.continuous import Continuous

        Continuous(self).serve()
