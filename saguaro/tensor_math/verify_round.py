"""SD's and SSD's greedy verify and commit in one stage call, and its append, run eagerly by ``append``."""

from __future__ import annotations

import torch

from saguaro.tensor_math.verification import outcome_tokens, verify_greedy

# As in ar_round: in-place writes store values independent of the threads' order; lengths and finished are
# returned, never written (``lengths += taken`` would race in Inductor's parallel regions).


def append_tokens(
    tokens: torch.Tensor,  # [B, S] token buffer, written in place
    lengths: torch.Tensor,  # [B] long
    finished: torch.Tensor,  # [B] bool
    candidates: torch.Tensor,  # [B, n] tokens to append, in order
    counts: torch.Tensor,  # [B] how many of them each row offers
    is_eos: torch.Tensor,  # [B, n] bool: whether each candidate is an EOS token
    end: torch.Tensor | int,  # the length at which a row has its max_new_tokens ([] long, or an int)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Append the first ``counts[b]`` candidates to each active row in ``tokens`` in place, up to an EOS
    (kept) or ``end``, where the row finishes. Returns the counts taken, new ``lengths`` and ``finished``."""
    steps = torch.ones_like(candidates[:1]).cumsum(dim=1) - 1  # [1, n]: 0 .. n-1
    take = (
        (steps < counts[:, None]) & (steps < (end - lengths)[:, None]) & finished.logical_not()[:, None]
    )  # [B, n]
    is_eos = (is_eos & take).long()  # [B, n]
    take = take & (is_eos.cumsum(dim=1) - is_eos == 0)  # no EOS taken before it
    dest = (lengths[:, None] + steps).clamp_max(tokens.shape[1] - 1)  # [B, n]
    tokens.scatter_(1, dest, torch.where(take, candidates, tokens.gather(1, dest)))
    taken = take.sum(dim=1)  # [B]
    new_lengths = lengths + taken  # [B]
    return taken, new_lengths, finished | (is_eos.sum(dim=1) > 0) | (new_lengths >= end)


def verify_round_greedy(
    logits: torch.Tensor,  # [B, K+1, V] the verify's
    draft_tokens: torch.Tensor,  # [B, K]
    tokens: torch.Tensor,  # [B, S], written in place
    lengths: torch.Tensor,  # [B]
    finished: torch.Tensor,  # [B]
    padding: torch.Tensor,  # [B] left-pad counts
    eos_table: torch.Tensor,  # [V] bool: True at the EOS token ids
    end: torch.Tensor,  # [] long
):
    """``verify_greedy``, then ``x_1..x_a, r'`` appended. Returns ``outcome [4, B]`` (finished, lengths,
    accepted, next_token: the host's one read), ``lengths``, ``finished [B]``, the next draft inputs
    ``[B, 2]`` (ids, index, positions of the last two tokens), the next verify's index and positions."""
    accepted, next_token = verify_greedy(logits, draft_tokens)  # [B], [B]
    decided = outcome_tokens(draft_tokens, accepted, next_token)  # [B, K+1]
    _, lengths, finished = append_tokens(
        tokens, lengths, finished, decided, accepted + 1, eos_table[decided], end
    )
    outcome = torch.stack([finished.long(), lengths, accepted, next_token])  # [4, B]
    draft_index = torch.stack([lengths - 2, lengths - 1], dim=1)  # [B, 2]
    verify_index = lengths[:, None] - 1 + (torch.ones_like(decided[:1]).cumsum(dim=1) - 1)  # [B, K+1]
    return (
        outcome,
        lengths,
        finished,
        tokens.gather(1, draft_index),
        draft_index,
        draft_index - padding[:, None],
        verify_index,
        verify_index - padding[:, None],
    )
