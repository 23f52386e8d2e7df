"""A request that runs alone through ``program.stream`` (:mod:`saguaro.serve.continuous`): in mode ``ssd``, one
sampled with a seed. SSD's draft lane draws its randomness from one generator per call, so only alone are such
a request's tokens those of ``program.generate`` alone with its seed; the loop runs it between two rounds of the
running batches (once their rows end, where a batch runs SSD's rounds on the draft lane). A request whose client leaves stops being read at the next round, and
the generation ends at that round boundary."""

from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger(__name__)


def runs_alone(program, sampling) -> bool:
    """Whether ``sampling`` (a request's) runs alone rather than in a batch session of ``program``."""
    return program.config.mode == "ssd" and sampling.temperature > 0 and sampling.seed is not None


def run_alone(scheduler, job) -> None:
    """Decode ``job`` alone, handing out its tokens round by round; a failure fails the job, not the server."""
    program, metrics, s = scheduler.program, scheduler.metrics, job.sampling
    try:
        ids = torch.tensor([s.prompt_ids], dtype=torch.long)  # [1, T]
        metrics.batch_started()
        with program.stream(ids, max_new_tokens=s.max_tokens, temperature=s.temperature, seed=s.seed) as stream:
            last = time.perf_counter()
            for chunk in stream:
                now = time.perf_counter()
                if chunk.round > 0:
                    metrics.round(now - last, 1)
                last = now
                if job.done:
                    continue
                if job.leave:
                    job.done = True
                    metrics.row_left(job.leave)
                    break  # leaving the block stops the generation at its next round boundary
                job.take(chunk.new_tokens[0], chunk.finished[0], now, metrics, scheduler.eos)
        if stream.output is not None:
            metrics.batch_done(stream.output.stats, stream.output.counters)
        scheduler.check_lane(1)
    except Exception as exc:  # noqa: BLE001 - one failed request must not stop the server
        log.exception("a request run alone failed")
        job.fail(exc)
