"""Before ``saguaro serve`` says it is ready, the shapes its rounds will meet are compiled (``--warm-up``).

With Inductor (``compile="blocking"``), a stage compiles on its first call with new shapes: the first request,
then the first round at a batch size above one (Inductor compiles the batch size dynamic then, once), then
the first sampled request, each wait for the compile while every other request waits behind it. The warm-up runs each kind of batch the scheduler (:mod:`saguaro.serve.
continuous`) makes, through the same :class:`~saguaro.runtime.batching.BatchSession`: greedy and sampled, one
row and then two, and (where a tokenizer is given) greedy rows under a grammar; in mode ``ssd`` also a sampled batch of SD's rounds (where seeded requests planned SD go) and
a seeded sampled request alone (``program.stream``, as :mod:`saguaro.serve.alone` runs one planned SSD). Prompt lengths and store capacities are compiled dynamic from the first
call, so two short prompts cover them. The warm-up's tokens go nowhere; nothing is counted in ``/metrics``.
On the eager backend nothing needs compiling and it does nothing.
"""

from __future__ import annotations

import logging
import time

import torch

from saguaro import Grammar, SamplingControls
from saguaro.runtime.batching import BatchSession

log = logging.getLogger(__name__)

WARM_UP_TEXTS = ("def main():\n    return", "The first thing to say is")
WARM_UP_TOKENS = 8  # new tokens of each warm-up row: a few rounds
JOIN_TRIES = 4  # joins tried for each row a warm-up batch wants (a sampled row may end at once)
SAMPLED_TEMPERATURE = 0.8  # any temperature > 0 runs the sampled stages
WARM_UP_TOP_P = 0.95  # any control in effect runs the stage the controls decide from


def needs_warm_up(program) -> bool:
    """Whether ``program``'s stages compile on first use: Inductor's (a loaded artifact's are compiled already, and
    its warm-up costs a few rounds); eager: no."""
    return program.config.backend == "inductor"


def warm_up_prompts(tokenizer, vocab_size: int) -> list:
    """Two short prompts as token ids: the texts through ``tokenizer``, else ids counted from 1."""
    prompts = []
    for i, text in enumerate(WARM_UP_TEXTS):
        ids = list(tokenizer(text)["input_ids"]) if tokenizer is not None else []
        prompts.append(ids or [(1 + i + j) % vocab_size for j in range(6)])
    return prompts


def warm_up(program, tokenizer, max_batch: int) -> float:
    """Run every kind of batch the server will make once, so their stages are compiled; the seconds it took."""
    if not needs_warm_up(program):
        return 0.0
    started = time.perf_counter()
    prompts = warm_up_prompts(tokenizer, program.target.spec.vocab_size)
    for temperature in (0.0, SAMPLED_TEMPERATURE):
        log.info(
            "warm-up: %s rows, batch 1%s",
            "greedy" if temperature == 0 else "sampled",
            " and 2" if max_batch > 1 else "",
        )
        _batch(BatchSession(program, temperature), prompts[: 2 if max_batch > 1 else 1])
    if program.config.mode != "ar" and program.can_control:  # sampling controls: target.verify_logits
        log.info(
            "warm-up: sampled rows under sampling controls, batch 1%s", " and 2" if max_batch > 1 else ""
        )
        controls = SamplingControls.of(top_p=WARM_UP_TOP_P)
        _batch(
            BatchSession(program, SAMPLED_TEMPERATURE, controls=controls),
            prompts[: 2 if max_batch > 1 else 1],
        )
    if program.config.mode != "ar" and program.can_control and tokenizer is not None:
        # a grammar (structured output): the draft's one-token step under its masks; its batches run SD's rounds
        log.info("warm-up: rows under a grammar, batch 1%s", " and 2" if max_batch > 1 else "")
        grammar = Grammar.json_schema(None, tokenizer, program.target.spec.vocab_size, program.eos_token_id)
        _batch(
            BatchSession(program, 0.0, controls=SamplingControls.of(grammar=grammar)),
            prompts[: 2 if max_batch > 1 else 1],
        )
    if (
        program.config.mode == "ssd"
    ):  # seeded sampled requests: planned SD, a batch of SD's rounds; SSD, alone
        _batch(
            BatchSession(program, SAMPLED_TEMPERATURE, program.without_lane),
            prompts[: 2 if max_batch > 1 else 1],
        )
        ids = torch.tensor([prompts[0]], dtype=torch.long)  # [1, T]
        with program.stream(
            ids, max_new_tokens=WARM_UP_TOKENS, temperature=SAMPLED_TEMPERATURE, seed=0
        ) as stream:
            for _ in stream:
                pass
    seconds = time.perf_counter() - started
    log.info("warm-up done in %.1f s", seconds)
    return seconds


def _batch(session: BatchSession, prompts: list) -> None:
    """:func:`_rounds` at the program's ``k``, then, where SD's rounds run with ``k`` > 1, again at ``k`` 1: a
    session's rounds may draft fewer tokens (``runtime/speculation_length.py``), which compiles the verify's
    width dynamic once for one row and once for two."""
    _rounds(session, prompts, None)
    if session.run == "sd" and session.program.config.k > 1:
        _rounds(session, prompts, 1)


def _rounds(session: BatchSession, prompts: list, k: int | None) -> None:
    """One row, a round, then the next row joins (a batch of two), a round, and rounds until both end, each of
    ``k`` (None: the session's choice). A row that ended already (a sampled one may draw its end early) is replaced
    by another prompt's, a few times at most, so that the round of two rows runs."""
    for rows in range(1, len(prompts) + 1):
        for attempt in range(JOIN_TRIES):
            if session.size >= rows:
                break
            session.join(prompts[(rows - 1 + attempt) % len(prompts)], WARM_UP_TOKENS)
        session.step(k)
    for _ in range(4 * WARM_UP_TOKENS):
        if not session.size:
            return
        session.step(k)
    raise RuntimeError("warm-up: a batch did not end")  # a row ends at its budget: never expected
