"""Mode ``ar``: the target alone, one token a call, no host sync inside the loop: the rows still active are
read a round late (``LateRead``), so at most one round runs past the last EOS, appending nothing
(``docs/design.md``, "Host reads per round")."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from saguaro.core.stages import TARGET_ROUND, TARGET_STEP
from saguaro.runtime.base.model_runner import ModelRunner
from saguaro.runtime.base.state import DecodeState
from saguaro.runtime.base.stats import seconds_since
from saguaro.runtime.base.timing import LateRead, Stopwatch
from saguaro.runtime.decode.controlled import decide, in_effect

Launch = Callable[[], torch.Tensor]  # queues one round; returns the rows still active after it [] (device)


def decode_ar(target: ModelRunner, draft: ModelRunner | None, state: DecodeState, plan, first_tokens) -> None:
    """Mode ``ar`` (``draft``, ``plan``, ``first_tokens`` unused): :func:`run_rounds` of
    :func:`round_in_graph` where the target offers it (greedy, no control), else of :func:`round_by_step`."""
    if state.temperature == 0 and target.provides(TARGET_ROUND) and in_effect(state) is None:
        run_rounds(state, round_in_graph(target, state))
    else:
        run_rounds(state, round_by_step(target, state))


def round_by_step(target: ModelRunner, state: DecodeState) -> Launch:
    """A :data:`Launch` of ``target.step``, its token from ``controlled.decide``, appended on the host."""
    seqs = state.seqs

    def launch() -> torch.Tensor:
        index = seqs.tail_index(1)  # [B, 1]: the pending token
        (logits,) = target.run(
            TARGET_STEP, state.target_store, seqs.gather(index), seqs.positions(index), index
        )  # [B, V]
        token = decide(logits, state)
        seqs.append_one(token)
        return seqs.active.sum()  # []

    return launch


def round_in_graph(target: ModelRunner, state: DecodeState) -> Launch:
    """A :data:`Launch` of ``TARGET_ROUND``: step, argmax, append (``tensor_math.ar_round``) and the next
    query's slot claimed in one call; the step's tokens."""
    seqs, store = state.seqs, state.target_store
    index = seqs.tail_index(
        1
    )  # [B, 1]: the pending token, claimed by the first call; each round claims the next
    query = (seqs.gather(index), seqs.positions(index), index)  # input_ids, positions, write_slots [B, 1]
    branch = torch.zeros_like(index)  # [B, 1]: shared
    eos_table = seqs.eos_table(target.spec.vocab_size)  # [V]
    claimed = False

    def launch() -> torch.Tensor:
        nonlocal query, claimed
        *query, lengths, finished, still_active = target.run(
            TARGET_ROUND,
            store,
            *query,
            seqs.tokens,
            seqs.lengths,
            seqs.finished,
            seqs.padding,
            eos_table,
            seqs.end,
            branch=branch,
            claimed=claimed,
        )
        claimed = True
        seqs.set_lengths_and_finished(lengths, finished)
        return still_active

    return launch


def run_rounds(state: DecodeState, launch: Launch) -> None:
    """Queue ``launch`` until every row has finished: round ``t`` is queued before the host reads what round
    ``t-1`` left active; a round past the end is not counted. One synchronous read, after the last round."""
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
    """Count a round begun at ``started`` (``decided``: one per active row), then ``round_committed``."""
    counters = state.counters
    counters.accepted_lengths.extend(decided)
    counters.rounds += 1
    counters.end_round(seconds_since(started), decided)
    state.round_committed()
