"""Continuous batching at round granularity for modes ``ar``, ``sd`` and ``ssd`` (:mod:`saguaro.serve.scheduler`).

Each turn of the loop, at a round boundary: the rows whose request ended early (client gone, stop string)
leave their batch; waiting requests, in arrival order, up to ``max_batch`` rows in all, are prefilled alone
and join the running batch of their temperature (:class:`~saguaro.runtime.batching.BatchSession`; the first
token goes out at once); then every running batch decodes one round and each row's new tokens go out. A
request that arrives while rows decode so starts streaming after at most one round of theirs, not after
they end.

Mode ``ssd``: a request sampled with a seed runs alone (:mod:`saguaro.serve.alone`), between two rounds of the
running batches, unless a batch runs SSD's rounds on the draft lane (its rows would go on with SD): then it waits
for that batch's rows to end, and no request behind it joins meanwhile. One SSD batch holds the draft lane at a
time (the first temperature to start a batch); a batch of another temperature that starts while it runs decodes
with SD (``BatchSession.run``), exactly.
"""

from __future__ import annotations

import logging
import time

from saguaro.runtime.batching import BatchSession
from saguaro.serve.alone import run_alone, runs_alone

log = logging.getLogger(__name__)


class Continuous:
    """The scheduler's loop: one session per temperature (and, in mode ``ssd``, seeded requests alone)."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.sessions: dict[float, BatchSession] = {}
        self.jobs: dict[tuple, object] = {}  # (temperature, row id) -> the Job decoding in that row

    def serve(self) -> None:
        scheduler = self.scheduler
        while True:
            with scheduler.cond:
                if not scheduler.wait_for_work(busy=bool(self.jobs)):
                    return
                joining, alone = self._take(scheduler.max_batch - len(self.jobs))
                scheduler.running = len(self.jobs) + len(joining) + (alone is not None)
            if alone is not None:
                run_alone(scheduler, alone)  # between two rounds of the running batches, if any
            self._free_rows_left()
            for job in joining:
                self._join(job)
            for temperature, session in list(self.sessions.items()):
                if session.size:
                    self._round(temperature, session)
                if not session.size:
                    self.sessions.pop(temperature, None)
            with scheduler.cond:
                scheduler.running = len(self.jobs)

    def _take(self, most: int) -> tuple[list, object]:
        """Under the lock: up to ``most`` waiting requests that join a batch, in arrival order, and the first that
        runs alone (or None). While a batch runs SSD's rounds on the lane, a request that runs alone waits for its
        rows to end, and no request behind it joins meanwhile; otherwise it runs now, before the next round."""
        scheduler = self.scheduler
        if scheduler.program.config.mode != "ssd":
            return scheduler.take_waiting(most), None
        scheduler.take_waiting(0)  # drops the requests whose client left
        lane_busy = any(session.size and session.run == "ssd" for session in self.sessions.values())
        joining, alone = [], None
        while scheduler.waiting and len(joining) < most:
            if runs_alone(scheduler.program, scheduler.waiting[0].sampling):
                if lane_busy or alone is not None:
                    break
                alone = scheduler.waiting.popleft()
                continue
            joining.append(scheduler.waiting.popleft())
        return joining, alone

    def _free_rows_left(self) -> None:
        """The rows whose request ended early leave their batch before its next round."""
        for key, job in list(self.jobs.items()):
            if job.leave:
                job.done = True
                self.scheduler.metrics.row_left(job.leave)
                self.sessions[key[0]].leave(key[1])
                del self.jobs[key]

    def _join(self, job) -> None:
        scheduler, sampling = self.scheduler, job.sampling
        session = self.sessions.get(sampling.temperature)
        try:
            if session is None:
                session = self.sessions[sampling.temperature] = BatchSession(scheduler.program, sampling.temperature)
            if not session.size:
                scheduler.metrics.batch_started()  # a batch starts when its first row joins
            first = session.join(sampling.prompt_ids, sampling.max_tokens, seed=sampling.seed)
        except Exception as exc:  # noqa: BLE001 - one failed request must not stop the server
            log.exception("a request's prefill failed")
            job.fail(exc)
            return
        # the session cuts each row at its max_tokens as the job does: a job done here is a row that never joined
        if not job.take(first.new_tokens, first.finished, time.perf_counter(), scheduler.metrics, scheduler.eos):
            self.jobs[(sampling.temperature, first.row)] = job

    def _round(self, temperature: float, session: BatchSession) -> None:
        scheduler, metrics = self.scheduler, self.scheduler.metrics
        started = time.perf_counter()
        try:
            results = session.step()
        except Exception as exc:  # noqa: BLE001 - one failed batch must not stop the server
            log.exception("a round of %d row(s) failed", session.size)
            for key in [key for key in self.jobs if key[0] == temperature]:
                self.jobs.pop(key).fail(exc)
            self.sessions.pop(temperature)
            if session.ssd is not None:
                session.ssd.release()  # the lane serves the next batch
            return
        now = time.perf_counter()
        metrics.round(now - started, len(results))
        metrics.accepted(session.counters.accepted_lengths if session.run != "ar" else [])  # this round's
        if session.mode == "ssd":
            metrics.cache(session.counters)
            scheduler.check_lane(len(results))
        for got in results:
            job = self.jobs.get((temperature, got.row))
            if job is None or job.done:
                continue
            if job.take(got.new_tokens, got.finished, now, metrics, scheduler.eos):  # and the row ends with it
                del self.jobs[(temperature, got.row)]
