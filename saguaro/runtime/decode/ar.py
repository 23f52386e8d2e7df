"""Mode ``ar``: the target alone, one token per target call."""

from __future__ import annotations

import time

from saguaro.core.stages import TARGET_STEP
from saguaro.runtime.base.model_runner import ModelRunner
from saguaro.runtime.base.state import DecodeState
from saguaro.runtime.base.stats import since
from saguaro.tensor_math.verification import sample_tokens


def decode_ar(target: ModelRunner, draft: ModelRunner | None, state: DecodeState, plan, first_tokens) -> None:
    """Extend every row one token per round until all rows finish (the draft, the plan and the first
    tokens, already in ``state``, are not needed: the signature is every decoder's)."""
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
        counters.accepted_lengths.extend(decided)
        counters.rounds += 1
        counters.end_round(since(started), decided)
        state.round_committed()
