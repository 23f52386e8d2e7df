"""AR's round after the target's step, as plain tensor functions: the greedy token appended to each
row (:func:`append_token`, which :meth:`~saguaro.runtime.base.sequences.SequenceBatch.append_one` runs
eagerly) and, spliced into the step's graph by ``splice_epilogue`` (stage ``target.step_greedy``), the
whole round: append, then claim the next round's KV slot and return its query, so that an AR token is
one stage call and one read of a count on the host."""

from __future__ import annotations

import torch


def append_token(
    tokens: torch.Tensor,  # [B, S] token buffer, written in place
    lengths: torch.Tensor,  # [B] long, written in place
    finished: torch.Tensor,  # [B] bool, written in place
    token: torch.Tensor,  # [B] one new token per row
    is_eos: torch.Tensor,  # [B] bool: whether each token is an EOS token
    end: torch.Tensor | int,  # the length at which a row has its max_new_tokens ([] long, or an int)
) -> None:
    """Append ``token`` to every row still active (not finished, shorter than ``end``): a row finishes at an
    EOS token (kept) or when it reaches ``end``. Finished rows keep their tokens."""
    take = finished.logical_not() & (lengths < end)  # [B]
    is_eos = is_eos & take  # [B]
    dest = lengths.clamp_max(tokens.shape[1] - 1)[:, None]  # [B, 1]
    tokens.scatter_(1, dest, torch.where(take[:, None], token[:, None], tokens.gather(1, dest)))
    lengths.add_(take)
    finished.bitwise_or_(is_eos | (lengths >= end))


def round_greedy(
    logits: torch.Tensor,  # [B, 1, V] the step's
    slot_pos: torch.Tensor,  # [B, S] the KV store's slot positions, written in place
    slot_branch: torch.Tensor,  # [B, S] its slot branches, written in place
    tokens: torch.Tensor,  # [B, S]
    lengths: torch.Tensor,  # [B]
    finished: torch.Tensor,  # [B]
    padding: torch.Tensor,  # [B] left-pad counts
    eos_table: torch.Tensor,  # [V] bool: True at the EOS token ids (one size per model, unlike the id list)
    end: torch.Tensor,  # [] long
):
    """AR's round at temperature 0 after the step: the argmax token appended (:func:`append_token`), then
    the next round's pending token claimed in the KV store (its slot is its index, its position the
    index less the row's padding, branch 0: ``KVStore.claim``'s effect). Returns the next round's
    ``input_ids``, ``positions`` and ``write_slots`` ``[B, 1]`` and the number of active rows ``[]``.
    A finished row's query is its last token again, which rewrites the same slot with the same values."""
    token = logits[:, -1].argmax(dim=-1)  # [B]
    append_token(tokens, lengths, finished, token, eos_table[token], end)
    index = (lengths - 1)[:, None]  # [B, 1]: the pending token
    positions = index - padding[:, None]  # [B, 1]
    slot_pos.scatter_(1, index, positions)
    slot_branch.scatter_(1, index, torch.zeros_like(index))
    return tokens.gather(1, index), positions, index, finished.logical_not().sum()
