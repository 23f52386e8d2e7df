"""Mode ``ar``: the target alone, one token per target call."""

from __future__ import annotations

import time

import torch

from saguaro.core.stages import TARGET_ROUND, TARGET_STEP
from saguaro.runtime.base.model_runner import ModelRunner
from saguaro.runtime.base.state import DecodeState
from saguaro.runtime.base.stats import since
from saguaro.tensor_math.verification import sample_tokens


def decode_ar(target: ModelRunner, draft: ModelRunner | None, state: DecodeState, plan, first_tokens) -> None:
    """Extend every row one token per round until all rows finish (the draft, the plan and the first
    tokens, already in ``state``, are not needed: the signature is every decoder's). Greedy rounds run in
    one stage call each where the target offers AR's round stage (:func:`decode_ar_in_graph`)."""
    if state.temperature == 0 and target.provides(TARGET_ROUND):
        decode_ar_in_graph(target, state)
        return
    seqs, counters = state.seqs, state.counters
    while not seqs.all_finished():
        index = seqs.tail_index(1)  # [B, 1]: the pending token
        started = time.perf_counter()
        (logits,) = target.run(TARGET_STEP, state.target_store, seqs.gather(index), seqs.positions(index),
                               index)  # [B, V]
        counters.verify_s += since(started)
        token, _ = sample_tokens(logits, state.temperature, state.generator)
        decided = [1] * sum(seqs.host_active)  # fresh: all_finished() above read it
        seqs.append_one(token)
        end_round(state, started, decided)


def decode_ar_in_graph(target: ModelRunner, state: DecodeState) -> None:
    """Greedy AR by :data:`~saguaro.core.stages.TARGET_ROUND`: each call runs the step, appends its argmax
    to the sequence buffers, claims the next round's slot and returns that round's query, so a token costs
    one stage call and one host read (the number of rows still active); the same tokens as the step's
    rounds, the same function appending them (``tensor_math.ar_round``)."""
    seqs, counters, store = state.seqs, state.counters, state.target_store
    active = sum(seqs.host_active)
    if not active:
        return
    index = seqs.tail_index(1)  # [B, 1]: the pending token, claimed by the first call; each round claims the next
    input_ids, positions = seqs.gather(index), seqs.positions(index)  # [B, 1], [B, 1]
    branch = torch.zeros_like(positions)  # [B, 1]: shared
    claimed = False
    eos_table = seqs.eos_table(target.spec.vocab_size)  # [V]
    while active:
        started = time.perf_counter()
        input_ids, positions, index, lengths, finished, still_active = target.run(
            TARGET_ROUND, store, input_ids, positions, index, seqs.tokens, seqs.lengths, seqs.finished, seqs.padding,
            eos_table, seqs.end, branch=branch, claimed=claimed)
        claimed = True
        decided = [1] * active
        active = int(still_active)  # the round's one device-to-host read
        counters.verify_s += since(started)
        seqs.advanced(lengths, finished)
        end_round(state, started, decided)


def end_round(state: DecodeState, started: float, decided: list) -> None:
    """Count a round of one token per active row (``decided``) that began at ``started`` and hand it on."""
    counters = state.counters
    counters.accepted_lengths.extend(decided)
    counters.rounds += 1
    counters.end_round(since(started), decided)
    state.round_committed()
