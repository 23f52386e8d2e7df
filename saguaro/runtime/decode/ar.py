"""Mode ``ar``: the target alone, one token per target call, and no host sync in the round.

Each round is queued on the device without waiting for the one before: the host learns how many rows
are still active a round late, through a :class:`~saguaro.runtime.base.timing.LateRead` (on CUDA a
``non_blocking`` copy into pinned memory and an event, taken while the next round runs), so the device
never idles for the host between rounds. The price is at most one round past the end, when the last
rows finish by EOS: a round on finished rows appends nothing (``tensor_math.ar_round.append_token``)
and is not counted. A finish by ``max_new_tokens`` the host sees coming, and stops on time.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from saguaro.core.stages import TARGET_ROUND, TARGET_STEP
from saguaro.runtime.base.model_runner import ModelRunner
from saguaro.runtime.base.state import DecodeState
from saguaro.runtime.base.stats import since
from saguaro.runtime.base.timing import LateRead, Stopwatch
from saguaro.runtime.decode.controlled import decide, in_effect

Launch = Callable[[], torch.Tensor]  # queues one round; returns the rows still active after it [] (device)


def decode_ar(target: ModelRunner, draft: ModelRunner | None, state: DecodeState, plan, first_tokens) -> None:
    """Extend every row one token per round until all rows finish (the draft, the plan and the first
    tokens, already in ``state``, are not needed: the signature is every decoder's). Greedy rounds run in
    one stage call each where the target offers AR's round stage (:func:`round_in_graph`), other rounds
    by the step (:func:`round_by_step`); :func:`run_rounds` runs either."""
    if state.temperature == 0 and target.provides(TARGET_ROUND) and in_effect(state) is None:
        run_rounds(state, round_in_graph(target, state))
    else:
        run_rounds(state, round_by_step(target, state))


def round_by_step(target: ModelRunner, state: DecodeState) -> Launch:
    """A round by ``target.step``: the step, a token drawn from its logits (the argmax at temperature 0)
    and appended by ``SequenceBatch.append_one``."""
    seqs = state.seqs

    def launch() -> torch.Tensor:
        index = seqs.tail_index(1)  # [B, 1]: the pending token
        (logits,) = target.run(TARGET_STEP, state.target_store, seqs.gather(index), seqs.positions(index),
                               index)  # [B, V]
        token = decide(logits, state)
        seqs.append_one(token)
        return seqs.active.sum()  # []
    return launch


def round_in_graph(target: ModelRunner, state: DecodeState) -> Launch:
    """A greedy round by :data:`~saguaro.core.stages.TARGET_ROUND`: one call runs the step, appends its
    argmax to the sequence buffers, claims the next round's slot and returns that round's query and the
    rows still active; the same tokens as the step's rounds, the same function appending them
    (``tensor_math.ar_round``)."""
    seqs, store = state.seqs, state.target_store
    index = seqs.tail_index(1)  # [B, 1]: the pending token, claimed by the first call; each round claims the next
    query = (seqs.gather(index), seqs.positions(index), index)  # input_ids, positions, write_slots [B, 1]
    branch = torch.zeros_like(index)  # [B, 1]: shared
    eos_table = seqs.eos_table(target.spec.vocab_size)  # [V]
    claimed = False

    def launch() -> torch.Tensor:
        nonlocal query, claimed
        *query, lengths, finished, still_active = target.run(
            TARGET_ROUND, store, *query, seqs.tokens, seqs.lengths,
            seqs.finished, seqs.padding, eos_table, seqs.end, branch=branch, claimed=claimed)
        claimed = True
        seqs.advanced(lengths, finished)
        return still_active
    return launch


def run_rounds(state: DecodeState, launch: Launch) -> None:
    """Queue rounds (``launch``) until every row has finished, reading the rows still active a round late:
    round ``t`` is queued before the host takes what round ``t-1`` left active. When that is none, round
    ``t`` ran on finished rows only, appended nothing, and ends the loop uncounted; when the rounds reach
    the longest budget (``max_new_tokens``), every row has finished without a read. The round itself reads
    nothing synchronously: its timing is counted once a later read has passed its events, and the one
    synchronous read, refreshing the sequences' host view for the result, comes after the last round."""
    seqs, counters = state.seqs, state.counters
    host_active = seqs.host_active  # fresh: the prefill's read (or the last SSD round's)
    before = sum(host_active)  # rows active before the round being queued
    if not before:
        return
    end = seqs.prompt_len + seqs.max_new_tokens
    rounds_left = max(end - length for length, on in zip(seqs.host_lengths, host_active) if on)
    late = LateRead(seqs.tokens.device)
    while True:
        started = time.perf_counter()
        watch = Stopwatch(seqs.tokens.device)  # device time: on CUDA, events on the caller's stream
        still_active = launch()  # []
        interval = watch.stop()
        late.post(still_active)
        rounds_left -= 1
        if late.pending > 1:
            before = late.take()  # what the round before left active, read while this one runs
        if not before:
            break  # this round ran past the end: every row had finished, so it appended nothing
        counters.time_verify(interval)
        end_round(state, started, [1] * before)
        if rounds_left == 0:
            break  # every row has its max_new_tokens
    seqs.read()  # the closing read: the host view the result and the stats need, once per generation


def end_round(state: DecodeState, started: float, decided: list) -> None:
    """Count a round of one token per active row (``decided``) that began at ``started`` and hand it on."""
    counters = state.counters
    counters.accepted_lengths.extend(decided)
    counters.rounds += 1
    counters.end_round(since(started), decided)
    state.round_committed()
