"""Mode ``sd``: ordinary speculative decoding. Draft ``k`` tokens, verify ``k+1`` in one target call.

:func:`verify` and :func:`commit` are the target side of every speculative round, SD's and SSD's.
"""

from __future__ import annotations

import time

import torch

from saguaro.core.stages import TARGET_VERIFY
from saguaro.runtime.draft.decode import draft_decode
from saguaro.runtime.base.model_runner import ModelRunner
from saguaro.runtime.base.state import DecodeState
from saguaro.runtime.base.stats import since
from saguaro.runtime.base.trace import traced
from saguaro.tensor_math import verification


def draft_speculation(draft: ModelRunner, state: DecodeState) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft ``k`` tokens after each row's pending token: ``tokens [B, k]`` and ``probs [B, k, V]``.

    The first draft call feeds the last two tokens of each row, so it (re)writes the draft KV of the
    token before ``r`` — missing when the previous round accepted every draft token — and of ``r``.
    """
    seqs = state.seqs
    index = seqs.tail_index(2)  # [B, 2]
    return draft_decode(draft, state.draft_store, seqs.gather(index), index, seqs.positions(index), state.k,
                        state.temperature, state.generator)


def verify(target: ModelRunner, state: DecodeState, draft_tokens: torch.Tensor,
           draft_probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One target call over ``[r, x_1..x_k]`` with verification fused in: ``(accepted [B], next [B])``."""
    seqs, k = state.seqs, state.k
    index = seqs.tail_index(1) + torch.arange(k + 1, device=draft_tokens.device)[None, :]  # [B, k+1]
    ids = torch.cat([seqs.gather(index[:, :1]), draft_tokens], dim=1)  # [B, k+1]
    state.target_store.invalidate_from(index[:, 0])  # drop the previous round's rejected slots
    positions = seqs.positions(index)
    stage = TARGET_VERIFY.at(state.temperature)
    started = time.perf_counter()
    if state.temperature == 0.0:
        accepted, next_token = target.run(stage, state.target_store, ids, positions, index, draft_tokens)
    else:
        accept_u, resample_u = verification.verification_uniforms(seqs.batch, k, state.generator, ids.device)
        inv_t = torch.tensor(1.0 / state.temperature, device=ids.device)
        accepted, next_token = target.run(stage, state.target_store, ids, positions, index, draft_tokens,
                                          draft_probs, inv_t, accept_u, resample_u)
    state.counters.verify_s += since(started)
    return accepted, next_token


def commit(state: DecodeState, draft_tokens: torch.Tensor, accepted: torch.Tensor,
           next_token: torch.Tensor) -> list:
    """Append ``x_1..x_a, r'`` to each active row and record the accepted length; returns the tokens
    decided per active row."""
    active = state.seqs.active.clone()
    state.seqs.append(verification.outcome_tokens(draft_tokens, accepted, next_token), accepted + 1)
    decided = (accepted[active] + 1).tolist()
    state.counters.accepted_lengths.extend(decided)
    state.counters.rounds += 1
    if state.recorder is not None:
        lengths = accepted[active] + 1
        state.recorder.counter("host", "accepted length", mean=float(lengths.float().mean()) if len(lengths) else 0.0)
    return decided


def decode_sd(target: ModelRunner, draft: ModelRunner, state: DecodeState, plan, first_tokens) -> None:
    """Mode ``sd`` (every decoder's signature; the plan and the first tokens, already in ``state``, are
    not needed): :func:`sd_rounds`."""
    sd_rounds(target, draft, state)


def sd_rounds(target: ModelRunner, draft: ModelRunner, state: DecodeState) -> None:
    """Alternate drafting and verification until every row finishes."""
    while not state.seqs.all_finished():
        with traced(state.recorder, "host", "round", {"round": state.counters.rounds + 1}):
            started = time.perf_counter()
            draft_tokens, draft_probs = draft_speculation(draft, state)
            state.counters.draft_s += since(started)
            accepted, next_token = verify(target, state, draft_tokens, draft_probs)
            state.counters.end_round(since(started), commit(state, draft_tokens, accepted, next_token))
