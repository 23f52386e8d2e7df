"""Continuous batching at round granularity for modes ``ar``, ``sd`` and ``ssd`` (:mod:`saguaro.serve.scheduler`).

Each turn of the loop, at a round boundary: the rows whose request ended early (client gone, stop string)
leave their batch; waiting requests, in arrival order, up to ``max_batch`` rows in all, are prefilled alone
and join the running batch of their temperature (:class:`~saguaro.runtime.batching.BatchSession`; the first
token goes out at once); then one running batch decodes a round and each of its rows' new tokens go out: the
batch whose rows have had the least of the rounds' time (a round's seconds over its rows), so that a row of a
batch with dear rounds (a few seeded rows speculating at ``config.k``) takes no more of the machine than a row
of a cheap one. A request that arrives while rows decode so starts streaming after at most one round (its
first token is decided as it joins), not after they end.

Mode ``ssd``: a request sampled with a seed is planned as ``generate`` plans it alone (``program.plan``,
:mod:`saguaro.serve.alone`): planned SD (the planner's verdict), it joins the batch of seeded rows of its
temperature that runs SD's rounds (one generator per row: its tokens are SD's alone with its seed, what
``generate`` gives it under that plan); planned SSD, it runs alone with that plan, between two rounds of the
running batches. Either waits while a batch runs SSD's rounds on the draft lane (its rows would go on with
SD), until that batch's rows end, and no request behind it joins meanwhile. One SSD batch holds the draft
lane at a time (the first temperature to start a batch); a batch of another temperature that starts while it
runs decodes with SD (``BatchSession.run``), exactly.

A session is keyed by ``(run, temperature, ignore_eos)`` (``run`` None: the program's mode; else the plan's, for
seeded rows of mode ``ssd``): rows that ignore EOS batch together, over the program without its EOS
(:class:`~saguaro.serve.scheduler.WithoutEos`). Each round, each row's figures (rounds, tokens decided, SSD cache
lookups and hits) go to its job (:mod:`saguaro.serve.figures`) before its tokens do, and its logprobs where asked
(scored by ``Job.take`` here, between rounds). A request with ``max_tokens`` 0 (``echo``) joins nothing: its
prompt is scored and it is done.
"""

from __future__ import annotations

import logging
import time

from saguaro.runtime.batching import BatchSession
from saguaro.serve.alone import controls_key, plan_alone, run_alone, runs_alone
from saguaro.serve.figures import HIT

log = logging.getLogger(__name__)
_said_runs_sd: list = []  # logged once per process: a grammar's batch in mode ssd runs SD's rounds


class Continuous:
    """The scheduler's loop: one session per temperature (mode ``ssd``: seeded requests planned alone first)."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        self.sessions: dict[tuple, BatchSession] = {}  # (run or None, temperature, ignore_eos) -> its session
        self.jobs: dict[tuple, object] = {}  # (session key, row id) -> the Job decoding in that row
        self.charged: dict[tuple, float] = {}  # session key -> the seconds of its rounds, each over its rows

    def _next_round(self):
        """The key of the running session whose rows have had the least time (each round's seconds over the rows
        it ran, summed): one round a turn, so every row gets an even share of the rounds' time whatever its
        session's round costs and yields (a session that joins starts level with the least served). None when
        no session runs a row."""
        running = [key for key, session in self.sessions.items() if session.size]
        if not running:
            return None
        level = min((self.charged[key] for key in running if key in self.charged), default=0.0)
        for key in running:
            self.charged.setdefault(key, level)
        return min(running, key=self.charged.__getitem__)

    def _charge(self, key, seconds: float, rows: int) -> None:
        """Charge the session of ``key`` one round of ``seconds`` over its ``rows`` (none where its round failed and
        it went)."""
        if key in self.sessions:
            self.charged[key] = self.charged.get(key, 0.0) + seconds / rows

    def serve(self) -> None:
        scheduler = self.scheduler
        while True:
            with scheduler.cond:
                if not scheduler.wait_for_work(busy=bool(self.jobs)):
                    return
                joining, seeded = self._take(scheduler.max_batch - len(self.jobs))
                scheduler.running = len(self.jobs) + len(joining) + len(seeded)
            for job in seeded:
                self._seeded(job)  # before the next round of the running batches, if any
            self._free_rows_left()
            for job in joining:
                self._join(job)
            key = self._next_round()
            if key is not None:
                session = self.sessions[key]
                rows, started = session.size, time.perf_counter()
                self._round(key, session)
                self._charge(key, time.perf_counter() - started, rows)
            for key, session in list(self.sessions.items()):
                if not session.size:
                    self._end_batch(key)
            with scheduler.cond:
                scheduler.running = len(self.jobs)

    def _take(self, most: int) -> tuple[list, list]:
        """Under the lock: up to ``most`` waiting requests, in arrival order: those that join a batch, and (mode
        ``ssd``) the seeded sampled ones, planned before they run. While a batch runs SSD's rounds on the lane, a
        seeded request waits for its rows to end, and no request behind it is taken meanwhile."""
        scheduler = self.scheduler
        if scheduler.program.config.mode != "ssd" and not any(
            job.sampling.controls is not None for job in scheduler.waiting
        ):
            return scheduler.take_waiting(most), []
        scheduler.take_waiting(0)  # drops the requests whose client left
        lane_busy = any(session.size and session.run == "ssd" for session in self.sessions.values())
        joining, seeded = [], []
        while scheduler.waiting and len(joining) + len(seeded) < most:
            if runs_alone(scheduler.program, scheduler.waiting[0].sampling):
                if lane_busy:
                    break
                seeded.append(scheduler.waiting.popleft())
                continue
            joining.append(scheduler.waiting.popleft())
        return joining, seeded

    def _free_rows_left(self) -> None:
        """The rows whose request ended early leave their batch before its next round."""
        for key, job in list(self.jobs.items()):
            if job.leave:
                job.done = True
                self.scheduler.metrics.row_left(job.leave)
                self.sessions[key[0]].leave(key[1])
                del self.jobs[key]

    def _end_batch(self, key) -> None:
        """The session of ``key`` runs no row: it goes, and so do the jobs still keyed to it (rows that ended as
        their request failed, its scoring: they leave, as :meth:`_free_rows_left` has them), so that a later
        session of the same key, whose row ids count from 0 again, never meets them."""
        self.sessions.pop(key, None)
        self.charged.pop(key, None)
        for job_key in [job_key for job_key in self.jobs if job_key[0] == key]:
            job = self.jobs.pop(job_key)
            if job.leave:
                self.scheduler.metrics.row_left(job.leave)
            elif not job.done:  # never expected: a running row keeps its batch
                job.fail(RuntimeError("the request's batch ended before its row did"))
            job.done = True

    def _seeded(self, job) -> None:
        """A seeded sampled request of mode ``ssd``: planned as ``generate`` alone plans it; SD (or AR) joins the
        seeded batch of that run, SSD runs alone with the plan."""
        if job.sampling.max_tokens == 0:
            self._prompt_only(job)
            return
        plan = plan_alone(self.scheduler, job)
        if plan is None:
            return  # the planning failed: the job has its error
        if plan.run == "ssd":
            run_alone(self.scheduler, job, plan)
        else:
            self._join(job, plan.run)

    def _join(self, job, mode: str | None = None) -> None:
        """``job`` joins the session of its kind (``mode`` None: the program's; its temperature; ``ignore_eos``),
        made over the program it decodes with (:meth:`Scheduler.program_for`) if none runs."""
        scheduler, sampling = self.scheduler, job.sampling
        if sampling.max_tokens == 0:
            self._prompt_only(job)
            return
        key = (mode, sampling.temperature, sampling.ignore_eos, controls_key(sampling.controls))
        session = self.sessions.get(key)
        try:
            if session is None:
                session = self.sessions[key] = BatchSession(
                    scheduler.program_for(sampling),
                    sampling.temperature,
                    mode,
                    controls=sampling.controls,
                    k_choice=scheduler.k_choice,
                )
            if not session.size:
                scheduler.metrics.batch_started()  # a batch starts when its first row joins
            first = session.join(sampling.prompt_ids, sampling.max_tokens, seed=sampling.seed)
        except Exception as exc:
            log.exception("a request's prefill failed")
            job.fail(exc)
            return
        job.figures.ran_as.add(session.run)
        if session.run != session.mode and not _said_runs_sd and getattr(sampling.controls, "grammar", None):
            _said_runs_sd.append(True)
            log.info(
                "structured output (response_format, tools) runs with SD's rounds in mode ssd: the draft lane "
                "cannot carry the grammar's state through its tree (usage.saguaro.ran_as says sd)"
            )
        job.figures.cached_tokens = first.prefix_cached
        # the session cuts each row at its max_tokens as the job does: a job done here is a row that never joined
        if not job.take(
            first.new_tokens, first.finished, time.perf_counter(), scheduler.metrics, scheduler.eos
        ):
            self.jobs[(key, first.row)] = job

    def _prompt_only(self, job) -> None:
        """``max_tokens`` 0 (``echo``: the prompt scored, as a loglikelihood asks): nothing decodes; the prompt's
        logprobs (where asked) and ``done`` go out now."""
        job.take([], True, time.perf_counter(), self.scheduler.metrics, self.scheduler.eos)

    def _round(self, key, session: BatchSession) -> None:
        scheduler, metrics = self.scheduler, self.scheduler.metrics
        started = time.perf_counter()
        try:
            results = session.step()
        except Exception as exc:
            log.exception("a round of %d row(s) failed", session.size)
            for row in [row for row in self.jobs if row[0] == key]:
                self.jobs.pop(row).fail(exc)
            self.sessions.pop(key)
            self.charged.pop(key, None)
            if session.ssd is not None:
                session.ssd.release()  # the lane serves the next batch
            return
        now = time.perf_counter()
        metrics.round(now - started, len(results))
        metrics.accepted(session.counters.accepted_lengths if session.run != "ar" else [])  # this round's
        if session.mode == "ssd":
            metrics.cache(session.counters)
            scheduler.check_lane(len(results))
        decided = session.counters.accepted_lengths
        decided = (
            decided if len(decided) == len(results) else [None] * len(results)
        )  # [rows], in results' order
        lookups = row_lookups(session, results)
        for i, got in enumerate(results):
            job = self.jobs.get((key, got.row))
            if job is None or job.done:
                continue
            job.figures.round(session.run, decided[i], lookups[i] if lookups is not None else None)
            if job.take(
                got.new_tokens, got.finished, now, metrics, scheduler.eos
            ):  # and the row ends with it
                del self.jobs[(key, got.row)]
        with scheduler.cond:  # the rows that ended make room at once (admission counts running rows)
            scheduler.running = len(self.jobs)


def row_lookups(session: BatchSession, results: list) -> list | None:
    """Each row's ``(looked up, hit)`` in the speculation cache in this SSD round, in ``results``' order, or None
    where that cannot be told row by row. A row still active on the device after the round was looked up (as
    ``ssd_round`` counts: also a row the host has just cut at its budget, whose device row runs to the capacity);
    it hit where its next speculation came from the cache. The sums must be the round's counted lookups and
    hits."""
    counters = session.counters
    if session.run != "ssd":
        return None
    if not counters.lookups:  # every row ended in this round: none was looked up
        return [(False, False)] * len(results)
    looked, sources = session.ssd_round_rows or ([], None)  # [rows], after the round
    if sources is None or not len(sources) == len(looked) == len(results):
        return None
    hit = [on and code == HIT for on, code in zip(looked, sources)]
    if sum(looked) != counters.lookups or sum(hit) != counters.hits:
        return None
    return list(zip(looked, hit))
