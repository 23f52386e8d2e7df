"""Mode ``sd``: ordinary speculative decoding. Draft ``k`` tokens, verify ``k+1`` in one target call."""

from __future__ import annotations

import torch

from saguaro.runtime import verification
from saguaro.runtime.model_runner import ModelRunner
from saguaro.runtime.state import DecodeState
from saguaro.runtime.draft_decode import draft_decode


def draft_speculation(draft: ModelRunner, state: DecodeState) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft ``k`` tokens after each row's pending token: ``tokens [B, k]`` and ``probs [B, k, V]``.

    The first draft call feeds the last two tokens of each row, so it (re)writes the draft KV of the
    token before ``r`` — missing when the previous round accepted every draft token — and of ``r``.
    """
    seqs = state.seqs
    index = seqs.tail_index(2)  # [B, 2]
    return draft_decode(draft, state.draft_store, seqs.gather(index), index, seqs.positions(index), state.k,
                        state.temperature, state.generator)


def verify_round(target: ModelRunner, state: DecodeState, draft_tokens: torch.Tensor,
                 draft_probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Target call over ``[r, x_1..x_k]``, verification, and the append; returns ``(accepted, next)``."""
    seqs, k = state.seqs, state.k
    index = seqs.tail_index(1) + torch.arange(k + 1, device=draft_tokens.device)[None, :]  # [B, k+1]
    ids = torch.cat([seqs.gather(index[:, :1]), draft_tokens], dim=1)  # [B, k+1]
    state.target_store.invalidate_from(index[:, 0])  # drop the previous round's rejected slots
    positions = seqs.positions(index)
    with state.timers.time("verify_s"):
        if state.temperature == 0.0:  # the fused stages return (accepted [B], next_token [B])
            accepted, next_token = target.run("verify_greedy", state.target_store, ids, positions, index,
                                              draft_tokens)
        else:
            accept_u, resample_u = verification.verification_uniforms(seqs.batch, k, state.generator, ids.device)
            inv_t = torch.tensor(1.0 / state.temperature, device=ids.device)
            accepted, next_token = target.run("verify_sampled", state.target_store, ids, positions, index,
                                              draft_tokens, draft_probs, inv_t, accept_u, resample_u)
    commit_outcome(state, draft_tokens, accepted, next_token)
    return accepted, next_token


def commit_outcome(state: DecodeState, draft_tokens: torch.Tensor, accepted: torch.Tensor,
                   next_token: torch.Tensor) -> None:
    """Append ``x_1..x_a, r'`` to each active row and record the accepted length."""
    active = state.seqs.active.clone()
    state.seqs.append(verification.outcome_tokens(draft_tokens, accepted, next_token), accepted + 1)
    state.accepted_lengths.extend((accepted[active] + 1).tolist())
    state.timers.count("rounds")


def decode_sd(target: ModelRunner, draft: ModelRunner, state: DecodeState) -> None:
    """Alternate drafting and verification until every row finishes."""
    while not state.seqs.all_finished():
        with state.timers.time("draft_s"):
            draft_tokens, draft_probs = draft_speculation(draft, state)
        verify_round(target, state, draft_tokens, draft_probs)
