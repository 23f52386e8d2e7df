"""The scheduler: one thread that owns the Program and serves queued requests in batches, a round at a time.

Design (what is continuous and what is not yet): the runtime decodes a static batch per
``program.stream`` call, so the scheduler runs batches back to back. Each batch takes, in arrival order,
up to ``max_batch`` waiting greedy requests whose prompts and budgets fit the program together (or
unseeded sampled requests of one temperature). A request sampled with a seed runs in a batch of its
own: the runtime draws one generator per call, so only alone are its tokens those of
``program.generate`` alone with its seed. A request that arrives while a batch
decodes waits for that batch to end; it does not yet join the running batch at the next round. A row
whose request has ended (its ``max_tokens``, EOS, a stop string, or its client gone) stops being read at
the next round and the batch ends at the next round boundary once no row is wanted; until then the row
is still decoded with its batch mates (the runtime has no way to drop a row of a running batch).
Greedy rows give the tokens each request gives alone: a row's tokens do not depend on its batch mates
(left padding is masked), which the tests check against ``program.generate`` alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import torch

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


def eos_set(eos_token_id) -> set:
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(t) for t in eos_token_id}


class Scheduler:
    """Queue at most ``max_queue`` waiting requests (:meth:`submit` refuses more with 429) and run batches
    of at most ``max_batch`` rows on one thread; :meth:`stop` finishes what was accepted, then ends."""

    def __init__(self, program, metrics, max_batch: int = 8, max_queue: int = 64):
        self.program, self.metrics = program, metrics
        self.max_batch, self.max_queue = max_batch, max_queue
        self.eos = eos_set(program.eos_token_id)
        self.waiting: deque = deque()
        self.running = 0
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

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.waiting and not self.closing:
                    self.cond.wait()
                if not self.waiting:
                    return
                batch = self._take()
                self.running = len(batch)
            try:
                if batch:
                    self._run(batch)
            except Exception as exc:  # noqa: BLE001 - one failed batch must not stop the server
                log.exception("a batch of %d request(s) failed", len(batch))
                for job in batch:
                    if not job.done:
                        job.done = True
                        job.send(("error", f"generation failed: {exc}"))
            finally:
                with self.cond:
                    self.running = 0

    def _take(self) -> list:
        """The next batch (under the lock): the head request and, unless it is sampled with a seed, the requests
        after it of its kind that fit (longest prompt + largest max_tokens within the program's max_length):
        greedy with greedy, unseeded sampled with unseeded sampled at the same temperature (one generator for
        the call: each row still draws from its own distribution; only a seed asks for a call alone)."""
        for job in [j for j in self.waiting if j.leave]:
            self.waiting.remove(job)  # its client left while it waited
        if not self.waiting:
            return []
        head = self.waiting[0]
        batch = [head]
        if head.sampling.temperature == 0 or head.sampling.seed is None:  # a seeded sampled request: alone
            kind = (head.sampling.temperature, head.sampling.seed)
            longest, budget = len(head.sampling.prompt_ids), head.sampling.max_tokens
            for job in list(self.waiting)[1:]:
                if len(batch) == self.max_batch:
                    break
                s = job.sampling
                t, m = max(longest, len(s.prompt_ids)), max(budget, s.max_tokens)
                if (s.temperature, s.seed) == kind and t + m <= self.program.max_length:
                    batch.append(job)
                    longest, budget = t, m
        for job in batch:
            self.waiting.remove(job)
        return batch

    def _run(self, batch: list) -> None:
        rows, width = len(batch), max(len(j.sampling.prompt_ids) for j in batch)
        ids = torch.full((rows, width), self.program.pad_token_id, dtype=torch.long)  # [B, T] left-padded
        mask = torch.zeros((rows, width), dtype=torch.long)  # [B, T]
        for i, job in enumerate(batch):
            prompt = job.sampling.prompt_ids
            ids[i, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[i, width - len(prompt):] = 1
        head = batch[0].sampling
        options = dict(attention_mask=mask, max_new_tokens=max(j.sampling.max_tokens for j in batch),
                       temperature=head.temperature, seed=head.seed if head.temperature > 0 else None)
        self.metrics.batch_started()
        with self.program.stream(ids, **options) as stream:
            last = time.perf_counter()
            for chunk in stream:
                now = time.perf_counter()
                live = self._hand_out(batch, chunk, now)
                if chunk.round > 0:
                    self.metrics.round(now - last, sum(not f for f in chunk.finished))
                last = now
                if not live and not all(chunk.finished):
                    break  # no row is wanted: leaving the block stops the generation at its next round boundary
        if stream.output is not None:
            self.metrics.batch_done(stream.output.stats, stream.output.counters)
        if self.lane_failures > self._lane_failures_seen:
            self._lane_failures_seen = self.lane_failures
            log.warning("the draft lane failed during a batch of %d request(s); its rounds finished exactly with SD "
                        "(the next SSD batch starts a new lane) and the server keeps serving", rows)

    def _hand_out(self, batch: list, chunk, now: float) -> int:
        """Give each wanted row its new tokens; end the rows that are done. Returns the rows still wanted."""
        live = 0
        for i, job in enumerate(batch):
            if job.done:
                continue
            if job.leave:
                job.done = True
                self.metrics.row_left(job.leave)
                continue
            new = chunk.new_tokens[i][:job.sampling.max_tokens - len(job.tokens)]
            if new:
                if job.first_token_s is None:
                    job.first_token_s = now - job.arrived
                    self.metrics.first_token(job.first_token_s)
                job.tokens += new
                job.send(("tokens", new))
            if len(job.tokens) >= job.sampling.max_tokens or chunk.finished[i]:
                job.done = True
                job.send(("done", "stop" if job.tokens and job.tokens[-1] in self.eos else "length"))
            else:
                live += 1
        return live
