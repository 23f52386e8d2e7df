"""SSD's batches, run back to back (:mod:`saguaro.serve.scheduler`): SSD's draft lane decodes a static batch
per ``program.stream`` call, so a batch takes, in arrival order, up to ``max_batch`` waiting greedy requests
whose prompts and budgets fit the program together (or unseeded sampled requests of one temperature). A
request sampled with a seed runs in a batch of its own: the runtime draws one generator per call, so only
alone are its tokens those of ``program.generate`` alone with its seed. A request that arrives while a batch
decodes waits for that batch to end. A row whose request has ended stops being read at the next round, and
the batch ends at the next round boundary once no row is wanted; until then the row is still decoded with
its batch mates. Greedy rows give the tokens each request gives alone: a row's tokens do not depend on its
batch mates (left padding is masked)."""

from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger(__name__)


class BackToBack:
    """The scheduler's loop for mode ``ssd``."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def serve(self) -> None:
        scheduler = self.scheduler
        while True:
            with scheduler.cond:
                if not scheduler.wait_for_work(busy=False):
                    return
                batch = self._take()
                scheduler.running = len(batch)
            try:
                if batch:
                    self._run(batch)
            except Exception as exc:  # noqa: BLE001 - one failed batch must not stop the server
                log.exception("a batch of %d request(s) failed", len(batch))
                for job in batch:
                    job.fail(exc)
            finally:
                with scheduler.cond:
                    scheduler.running = 0

    def _take(self) -> list:
        """The next batch (under the lock): the head request and, unless it is sampled with a seed, the requests
        after it of its kind that fit (longest prompt + largest max_tokens within the program's max_length):
        greedy with greedy, unseeded sampled with unseeded sampled at the same temperature (one generator for
        the call: each row still draws from its own distribution; only a seed asks for a call alone)."""
        scheduler = self.scheduler
        head = scheduler.take_waiting(1)
        if not head:
            return []
        batch = head
        if head[0].sampling.temperature == 0 or head[0].sampling.seed is None:  # a seeded sampled request: alone
            kind = (head[0].sampling.temperature, head[0].sampling.seed)
            longest, budget = len(head[0].sampling.prompt_ids), head[0].sampling.max_tokens
            for job in list(scheduler.waiting):
                if len(batch) == scheduler.max_batch:
                    break
                s = job.sampling
                t, m = max(longest, len(s.prompt_ids)), max(budget, s.max_tokens)
                if (s.temperature, s.seed) == kind and t + m <= scheduler.program.max_length:
                    batch.append(job)
                    scheduler.waiting.remove(job)
                    longest, budget = t, m
        return batch

    def _run(self, batch: list) -> None:
        scheduler = self.scheduler
        program, metrics = scheduler.program, scheduler.metrics
        rows, width = len(batch), max(len(j.sampling.prompt_ids) for j in batch)
        ids = torch.full((rows, width), program.pad_token_id, dtype=torch.long)  # [B, T] left-padded
        mask = torch.zeros((rows, width), dtype=torch.long)  # [B, T]
        for i, job in enumerate(batch):
            prompt = job.sampling.prompt_ids
            ids[i, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[i, width - len(prompt):] = 1
        head = batch[0].sampling
        options = dict(attention_mask=mask, max_new_tokens=max(j.sampling.max_tokens for j in batch),
                       temperature=head.temperature, seed=head.seed if head.temperature > 0 else None)
        metrics.batch_started()
        with program.stream(ids, **options) as stream:
            last = time.perf_counter()
            for chunk in stream:
                now = time.perf_counter()
                live = self._hand_out(batch, chunk, now)
                if chunk.round > 0:
                    metrics.round(now - last, sum(not f for f in chunk.finished))
                last = now
                if not live and not all(chunk.finished):
                    break  # no row is wanted: leaving the block stops the generation at its next round boundary
        if stream.output is not None:
            metrics.batch_done(stream.output.stats, stream.output.counters)
        scheduler.check_lane(rows)

    def _hand_out(self, batch: list, chunk, now: float) -> int:
        """Give each wanted row its new tokens; end the rows that are done. Returns the rows still wanted."""
        scheduler, live = self.scheduler, 0
        for i, job in enumerate(batch):
            if job.done:
                continue
            if job.leave:
                job.done = True
                scheduler.metrics.row_left(job.leave)
                continue
            if not job.take(chunk.new_tokens[i], chunk.finished[i], now, scheduler.metrics, scheduler.eos):
                live += 1
        return live
