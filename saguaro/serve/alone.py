"""A seeded sampled request of mode ``ssd`` (:mod:`saguaro.serve.continuous`): SSD's draft lane draws its
randomness from one generator per call, so only alone are such a request's SSD tokens those of
``program.generate`` alone with its seed. :func:`plan_alone` plans it as ``generate`` does (``program.plan``);
planned SSD, :func:`run_alone` runs it alone with that plan through ``program.stream``, between two rounds of
the running batches (once their rows end, where a batch runs SSD's rounds on the draft lane). A request whose
client leaves stops being read at the next round, and the generation ends at that round boundary. With
``ignore_eos`` both are called with ``eos_token_id=None``. Its ``done`` is sent once the generation has ended,
with the request's figures taken from the generation's own counters (:mod:`saguaro.serve.figures`). A request that
asks for logprobs gets its tokens once the generation has ended (``program.score`` cannot run while the stream holds
the program), scored then, in the rounds' chunks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

log = logging.getLogger(__name__)


def runs_alone(program, sampling) -> bool:
    """Whether ``sampling`` (a request's) runs alone rather than joining the batch session of its temperature
    and sampling controls in ``program``: seeded and sampled in mode ``ssd`` (planned first, :func:`plan_alone`),
    without a grammar (under one ``generate`` runs SD's rounds, as its batch session does: the row joins it)."""
    return (
        program.config.mode == "ssd"
        and sampling.temperature > 0
        and sampling.seed is not None
        and getattr(sampling.controls, "grammar", None) is None
    )


def controls_key(controls):
    """A hashable key, equal for equal sampling controls under the same grammar (a batch session's: a ``Grammar``
    compares by identity, :mod:`saguaro.serve.structured` hands out one per schema); None for none."""
    if controls is None:
        return None
    return replace(
        controls, grammar=None
    ), controls.grammar  # frozen, of numbers and tuples; the grammar itself


def plan_alone(scheduler, job):
    """``job``'s plan, as ``generate`` of it alone would plan now (the verdict counted), or None where planning
    failed (the job fails with the error, the server goes on)."""
    s = job.sampling
    try:
        ids = torch.tensor([s.prompt_ids], dtype=torch.long)  # [1, T]
        return scheduler.program.plan(
            ids, max_new_tokens=s.max_tokens, temperature=s.temperature, seed=s.seed, **eos_option(s)
        )
    except Exception as exc:
        log.exception("planning a request run alone failed")
        job.fail(exc)
        return None


def eos_option(sampling) -> dict:
    """``generate``'s ``eos_token_id`` for ``sampling``: None with ``ignore_eos``, else the program's default."""
    return {"eos_token_id": None} if sampling.ignore_eos else {}


def run_alone(scheduler, job, plan=None) -> None:
    """Decode ``job`` alone (with ``plan``, from :func:`plan_alone`), handing out its tokens round by round; a
    failure fails the job, not the server."""
    program, metrics, s = scheduler.program, scheduler.metrics, job.sampling
    try:
        ids = torch.tensor([s.prompt_ids], dtype=torch.long)  # [1, T]
        metrics.batch_started()
        held = []  # logprobs asked: the rounds' tokens, handed out once the stream has ended (it holds the program)
        with program.stream(
            ids,
            max_new_tokens=s.max_tokens,
            temperature=s.temperature,
            seed=s.seed,
            plan=plan,
            controls=s.controls,
            **eos_option(s),
        ) as stream:
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
                if s.logprobs is not None:
                    held.append((chunk.new_tokens[0], chunk.finished[0]))
                    continue
                job.take(chunk.new_tokens[0], chunk.finished[0], now, metrics, scheduler.eos, announce=False)
        for new, finished in held:  # scored now (Job.take), outside the stream's hold on the program
            if job.done or job.leave:
                break
            job.take(new, finished, time.perf_counter(), metrics, scheduler.eos, announce=False)
        if stream.output is not None:
            metrics.batch_done(stream.output.stats, stream.output.counters)
            job.figures.generation(
                stream.output.stats.get("ran_as", program.config.mode), stream.output.counters
            )
        job.finish()
        scheduler.check_lane(1)
    except Exception as exc:
        log.exception("a request run alone failed")
        job.fail(exc)
