"""The prompt's prefill, before any decoder's rounds: both stores filled, the first token decided."""

from __future__ import annotations

import time

import torch

from saguaro.core.stages import DRAFT_PREFILL, TARGET_PREFILL
from saguaro.runtime.base.model_runner import ModelRunner
from saguaro.runtime.base.state import DecodeState
from saguaro.runtime.base.stats import seconds_since
from saguaro.runtime.decode.controlled import decide


def prefill(target: ModelRunner, draft: ModelRunner | None, state: DecodeState) -> torch.Tensor:
    """Prefill the target's store (and the draft's, for SD: ``state.draft_store``) with the prompt and
    decide the first token ``[B]`` from the target (streamed as round 0). With ``state.prefix_cache`` and one
    row, the prompt's longest cached prefix is copied into the stores and only the rest is prefilled; the
    prompt's KV is then cached (``runtime/base/prefix_cache.py``)."""
    seqs = state.seqs
    T = seqs.prompt_len
    index = torch.arange(T, device=seqs.tokens.device).expand(seqs.batch, T)  # [B, T]
    ids, pos = seqs.tokens[:, :T], seqs.prompt_positions()
    started = time.perf_counter()
    cache, start = state.prefix_cache if seqs.batch == 1 else None, 0
    if cache is not None:
        column = int(seqs.padding[0])
        prompt = seqs.tokens[0, column:T].tolist()
        reused = cache.restore(prompt, column, state.target_store, state.draft_store)
        state.counters.prefix_reused += reused
        start = column + reused if reused else 0  # nothing reused: the prefill the cache-less path runs
        ids, pos, index = ids[:, start:], pos[:, start:], index[:, start:]
    (logits,) = target.run(TARGET_PREFILL, state.target_store, ids, pos, index)  # [B, V]
    if state.draft_store is not None:
        draft.run(DRAFT_PREFILL, state.draft_store, ids, pos, index)
    if cache is not None:
        cache.keep(prompt, column, state.target_store, state.draft_store)
    state.counters.prefill_s += seconds_since(started)
    first = decide(logits, state)
    seqs.append_one(first)
    seqs.read()  # the host view the rounds start from (a row may finish on its first token)
    state.round_committed()
    return first
