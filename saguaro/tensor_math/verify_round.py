"""A speculative round's commit after the target's verify, as plain tensor functions: the decided tokens
``x_1..x_a, r'`` appended to each row (:func:`append_tokens`, which
:meth:`~saguaro.runtime.base.sequences.SequenceBatch.append` runs eagerly) and, spliced into the verify's
graph by ``splice_epilogue`` (stage ``target.verify_round_greedy``), the whole greedy round: verification,
append, the round's outcome packed for its one read on the host, and the next round's inputs (the draft's
first step and the next verify), so that SD's and SSD's greedy verify and commit are one stage call.

As in :mod:`~saguaro.tensor_math.ar_round`, the new ``lengths`` and ``finished`` are returned, never written
over their inputs (Inductor's C++ kernels may run a one-element statement on every thread of a parallel
region: ``lengths += taken`` would race); the token buffer is written in place, each slot with a value that
does not depend on the order of the writes (the new token, or the slot's own)."""

from __future__ import annotations

import torch

from saguaro.tensor_math.verification import outcome_tokens, verify_greedy


def append_tokens(
    tokens: torch.Tensor,  # [B, S] token buffer, written in place
    lengths: torch.Tensor,  # [B] long
    finished: torch.Tensor,  # [B] bool
    candidates: torch.Tensor,  # [B, n] tokens to append, in order
    counts: torch.Tensor,  # [B] how many of them each row offers
    is_eos: torch.Tensor,  # [B, n] bool: whether each candidate is an EOS token
    end: torch.Tensor | int,  # the length at which a row has its max_new_tokens ([] long, or an int)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Append the first ``counts[b]`` of ``candidates`` to each active row (not finished), stopping at the
    first EOS (kept) and at ``end``; a row finishes at an EOS or at ``end``. Writes ``tokens`` in place and
    returns how many tokens each row took, the new ``lengths`` and ``finished`` ``[B]`` (not written)."""
    steps = torch.ones_like(candidates[:1]).cumsum(dim=1) - 1  # [1, n]: 0 .. n-1
    take = (steps < counts[:, None]) & (steps < (end - lengths)[:, None]) & finished.logical_not()[:, None]  # [B, n]
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
    """A greedy speculative round after the verify: :func:`~saguaro.tensor_math.verification.verify_greedy`,
    then ``x_1..x_a, r'`` appended (:func:`append_tokens`). Returns the ``outcome [4, B]`` (the new finished
    flags, lengths, ``accepted`` and ``next_token`` as longs, in that order: the host's one read), the new
    ``lengths`` and ``finished [B]``, the next round's draft inputs (the token before the pending one and
    the pending one: ``draft_ids``, ``draft_index``, ``draft_positions [B, 2]``) and the next verify's slots
    and positions ``[B, K+1]`` (the pending token and the ``K`` after it)."""
    accepted, next_token = verify_greedy(logits, draft_tokens)  # [B], [B]
    decided = outcome_tokens(draft_tokens, accepted, next_token)  # [B, K+1]
    _, lengths, finished = append_tokens(tokens, lengths, finished, decided, accepted + 1, eos_table[decided], end)
    outcome = torch.stack([finished.long(), lengths, accepted, next_token])  # [4, B]
    draft_index = torch.stack([lengths - 2, lengths - 1], dim=1)  # [B, 2]
    verify_index = lengths[:, None] - 1 + (torch.ones_like(decided[:1]).cumsum(dim=1) - 1)  # [B, K+1]
    return (outcome, lengths, finished, tokens.gather(1, draft_index), draft_index, draft_index - padding[:, None],
            verify_index, verify_index - padding[:, None])
