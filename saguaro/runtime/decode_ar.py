"""Mode ``ar``: the target alone, one token per target call."""

from __future__ import annotations

import torch

from saguaro.runtime.model_runner import ModelRunner
from saguaro.runtime.state import DecodeState
from saguaro.runtime.verification import sample_tokens


def decode_ar(target: ModelRunner, state: DecodeState) -> None:
    """Extend every row one token per round until all rows finish."""
    seqs = state.seqs
    while not seqs.all_finished():
        index = seqs.tail_index(1)  # [B, 1]: the pending token
        with state.timers.time("verify_s"):
            (logits,) = target.run("step", state.target_store, seqs.gather(index), seqs.positions(index),
                                   index)  # [B, V]
        token, _ = sample_tokens(logits, state.temperature, state.generator)
        active = seqs.active.clone()
        seqs.append(token[:, None], torch.ones_like(token))
        state.accepted_lengths.extend([1] * int(active.sum()))
        state.timers.count("rounds")
