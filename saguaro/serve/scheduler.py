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

Admission: at most ``max_batch + max_queue`` jobs are accepted and unfinished at once (``max_queue=0``: none
waits beyond a full batch); a request's jobs (its choices) are accepted together or refused together (429 with
``Retry-After``). A job that asks to ignore EOS (``ignore_eos``) decodes in a batch of its own kind, over
:class:`WithoutEos` (the program with no end-of-sequence token: ``generate(eos_token_id=None)``'s tokens).

Logprobs: a job that asks for them has its tokens scored on this thread, between rounds (``Program.score``, the
target's own distribution: :mod:`saguaro.serve.logprobs`); one with ``max_tokens`` 0 (``echo``) decodes nothing,
its prompt scored and ``done`` sent when it is taken.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from saguaro.serve.figures import Figures
from saguaro.serve.logprobs import Scored, token_logprobs
from saguaro.serve.requests import RequestError, Sampling

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1  # what a 429 asks the client to wait (Retry-After, seconds)


class Job:
    """One choice of a request in the scheduler. ``deliver(event)`` is called on the scheduler's thread with
    ``("tokens", [ids])``, ``("done", finish_reason)`` or ``("error", message)``, and where the choice asks for
    logprobs (``sampling.logprobs``) ``("logprobs", Scored)`` (:mod:`saguaro.serve.logprobs`: before the tokens it
    scores, or, for a whole answer without stop strings, once before ``done``); the reader sets ``leave`` (a
    reason: client gone, stop string, timeout) to free the row at the next round. ``figures``: its rounds'
    speculation figures (:mod:`saguaro.serve.figures`), complete when ``done`` is sent. ``scorer``: what scores
    its tokens, ``(ids, start, top) -> [TokenLogprob]`` (:meth:`Scheduler.submit` sets it)."""

    def __init__(self, sampling: Sampling, deliver):
        self.sampling, self.deliver = sampling, deliver
        self.tokens: list = []
        self.leave: str | None = None
        self.arrived = time.perf_counter()
        self.first_token_s: float | None = None
        self.done = False
        self.figures = Figures(None)  # its mode set when submitted
        self.scorer = None
        self._reason: str | None = None
        self._scored = 0  # tokens whose logprobs went out
        self._prompt_scored = False

    @property
    def scores_each_round(self) -> bool:
        """Whether its logprobs go out with each hand-out of tokens (streamed, or with stop strings: its reader may
        end it at any round) rather than once when it is done."""
        return self.sampling.stream or bool(self.sampling.stop)

    def send(self, event) -> None:
        try:
            self.deliver(event)
        except RuntimeError:  # the event loop has closed (the server is gone): nobody is reading
            self.leave = self.leave or "server closed"

    def take(self, new: list, finished: bool, now: float, metrics, eos: set, announce: bool = True) -> bool:
        """Hand out the row's ``new`` tokens (cut at ``max_tokens``), their logprobs first where asked (scored here:
        the caller is the scheduler's thread, outside the program's lock); once the row ``finished`` or the budget
        is reached the job is done, and ``done`` is sent (``announce=False``: later, by :meth:`finish`). Returns
        whether the job is done; False also where scoring failed (the job fails, and leaves: its row is freed at
        the next round). ``eos``: the program's end-of-sequence ids (none count with ``ignore_eos``)."""
        new = new[: self.sampling.max_tokens - len(self.tokens)]
        if new:
            if self.first_token_s is None:
                self.first_token_s = now - self.arrived
                metrics.first_token(self.first_token_s)
            self.tokens += new
        s = self.sampling
        ends = len(self.tokens) >= s.max_tokens or finished
        unscored = len(self.tokens) > self._scored or (s.echo and not self._prompt_scored)
        if s.logprobs is not None and unscored and (ends or self.scores_each_round):
            try:
                self.send(("logprobs", self._score()))
            except Exception as exc:
                log.exception("scoring a request's tokens for its logprobs failed")
                self.fail(exc)
                self.leave = self.leave or "logprobs failed"
                return False
        if new:
            self.send(("tokens", new))
        if ends:
            self.done = True
            stopped = not s.ignore_eos and self.tokens and self.tokens[-1] in eos
            self._reason = "stop" if stopped else "length"
            if announce:
                self.finish()
        return self.done

    def _score(self) -> Scored:
        """The logprobs of the tokens not yet scored (and, the first time with ``echo``, of the prompt)."""
        if self.scorer is None:
            raise RuntimeError("this job has no scorer: submit it to a Scheduler to have its logprobs")
        s = self.sampling
        echo = s.echo and not self._prompt_scored
        start = 0 if echo else len(s.prompt_ids) + self._scored
        entries = self.scorer(s.prompt_ids + self.tokens, start, s.logprobs)
        prompt, tokens = (
            (entries[: len(s.prompt_ids)], entries[len(s.prompt_ids) :]) if echo else (None, entries)
        )
        self._prompt_scored, self._scored = self._prompt_scored or echo, len(self.tokens)
        return Scored(tokens, prompt)

    def finish(self) -> None:
        """Send ``done`` (after :meth:`take` with ``announce=False`` made the job done)."""
        if self._reason is not None:
            self.send(("done", self._reason))
            self._reason = None

    def fail(self, exc: Exception) -> None:
        """Send ``error`` (once); a job whose tokens all went out with its ``done`` held back gets that instead."""
        if self._reason is not None:
            self.finish()
        elif not self.done:
            self.done = True
            self.send(("error", f"generation failed: {exc}"))


def eos_set(eos_token_id) -> set:
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(t) for t in eos_token_id}


class WithoutEos:
    """``program`` seen with no end-of-sequence token: a ``BatchSession`` over it decodes its rows to their budget,
    as ``program.generate(..., eos_token_id=None)`` does (``BatchSession.join`` takes the program's own EOS ids).
    Everything else (stages, lock, draft lane, calibration) is the program's own."""

    eos_token_id = None

    def __init__(self, program):
        self.program = program

    def __getattr__(self, name):
        return getattr(self.program, name)


class Scheduler:
    """Decode at most ``max_batch`` rows at once on one thread, and hold at most ``max_queue`` more jobs waiting
    for a row (:meth:`submit` refuses past that with 429); :meth:`stop` finishes what was accepted, then ends."""

    def __init__(self, program, metrics, max_batch: int = 8, max_queue: int = 64, k_choice: str = "measured"):
        self.program, self.metrics, self.k_choice = program, metrics, k_choice
        self.max_batch, self.max_queue = max_batch, max_queue
        self.eos = eos_set(program.eos_token_id)
        self.without_eos = WithoutEos(program)
        self.waiting: deque = deque()
        self.running = 0  # rows decoding now
        self.closing = False
        self._lane_failures_seen = self.lane_failures
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._loop, name="saguaro-serve-scheduler", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, *jobs: Job) -> None:
        """Accept ``jobs`` (one request's choices) together, or raise :class:`RequestError`: 503 while closing,
        400 (``n``) for more than can ever run (``max_batch + max_queue``), 429 with ``Retry-After`` where the
        jobs running and waiting would pass ``max_batch + max_queue``."""
        most = self.max_batch + self.max_queue
        if len(jobs) > most:
            raise RequestError(
                f"the request asks for {len(jobs)} choices (n times its prompts); this server runs at "
                f"most {most} at once (--max-batch {self.max_batch} + --max-queue {self.max_queue})",
                "n",
            )
        with self.cond:
            if self.closing:
                raise RequestError(
                    "the server is shutting down and takes no new requests", None, 503, "unavailable"
                )
            if self.running + len(self.waiting) + len(jobs) > most:
                raise RequestError(
                    f"the server is full ({self.running} running, --max-batch {self.max_batch}; "
                    f"{len(self.waiting)} waiting, --max-queue {self.max_queue}); retry later",
                    None,
                    429,
                    "rate_limit_exceeded",
                    {"Retry-After": str(RETRY_AFTER_S)},
                )
            for job in jobs:
                job.figures.mode = self.program.config.mode
                job.scorer = self.score
            self.waiting.extend(jobs)
            self.cond.notify_all()

    def score(self, ids: list, start: int, top: int) -> list:
        """On the scheduler's thread: the :class:`~saguaro.serve.logprobs.TokenLogprob` of positions ``start..`` of
        ``ids`` with ``top`` alternatives each, from the program's target (``Program.score``)."""
        return token_logprobs(self.program, ids, start, top)

    def program_for(self, sampling: Sampling):
        """The program a job's rows decode over: the program, or :class:`WithoutEos` of it (``ignore_eos``)."""
        return self.without_eos if sampling.ignore_eos else self.program

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
            log.warning(
                "the draft lane failed during a batch of %d request(s); its rounds finished exactly with SD "
                "(the next SSD batch starts a new lane) and the server keeps serving",
                rows,
            )

    def _loop(self) -> None:
        from saguaro.serve.continuous import Continuous

        Continuous(self).serve()
