"""AR's round after the target's step, as plain tensor functions: the greedy token appended to each
row (:func:`append_token`, which :meth:`~saguaro.runtime.base.sequences.SequenceBatch.append_one` runs
eagerly) and, spliced into the step's graph by ``splice_epilogue`` (stage ``target.round_greedy``), the
whole round: append, then claim the next round's KV slot and return its query, so that an AR token is
one stage call and one read of a count on the host.

Inside a compiled graph the new ``lengths`` and ``finished`` are outputs, never written over their inputs:
Inductor's C++ kernels may run a one-element statement on every thread of a parallel region, which is
harmless for a write whose value does not depend on what it overwrites, and a race for ``lengths += 1``
(measured: wrong tokens at two threads when the round updated them in place). The writes left in place
(the token into its row, the slot's position and branch) store the same value however many threads run
them, in whatever order: a row's token slot gets the new token or keeps its own, decided by the unwritten
``lengths`` and ``finished``."""

from __future__ import annotations

import torch


def append_token(
    tokens: torch.Tensor,  # [B, S] token buffer, written in place
    lengths: torch.Tensor,  # [B] long
    finished: torch.Tensor,  # [B] bool
    token: torch.Tensor,  # [B] one new token per row
    is_eos: torch.Tensor,  # [B] bool: whether each token is an EOS token
    end: torch.Tensor | int,  # the length at which a row has its max_new_tokens ([] long, or an int)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Append ``token`` to every row still active (not finished, shorter than ``end``): a row finishes at an
    EOS token (kept) or when it reaches ``end``; finished rows keep their tokens. Writes ``tokens`` in place
    and returns the new ``lengths [B]`` and ``finished [B]`` (``lengths`` and ``finished`` are not written)."""
    take = finished.logical_not() & (lengths < end)  # [B]
    dest = lengths.clamp_max(tokens.shape[1] - 1)[:, None]  # [B, 1]
    tokens.scatter_(1, dest, torch.where(take[:, None], token[:, None], tokens.gather(1, dest)))
    new_lengths = lengths + take  # [B]
    return new_lengths, finished | (is_eos & take) | (new_lengths >= end)


def round_greedy(
    logits: torch.Tensor,  # [B, 1, V] the step's
    slot_pos: torch.Tensor,  # [B, S] the KV store's slot positions, written in place
    slot_branch: torch.Tensor,  # [B, S] its slot branches, written in place
    tokens: torch.Tensor,  # [B, S], written in place
    lengths: torch.Tensor,  # [B]
    finished: torch.Tensor,  # [B]
    padding: torch.Tensor,  # [B] left-pad counts
    eos_table: torch.Tensor,  # [V] bool: True at the EOS token ids (one size per model, unlike the id list)
    end: torch.Tensor,  # [] long
):
    """AR's round at temperature 0 after the step: the argmax token appended (:func:`append_token`), then
    the next round's pending token claimed in the KV store (its slot is its index, its position the
    index less the row's padding, branch 0: ``KVStore.claim``'s effect). Returns the next round's
    ``input_ids``, ``positions`` and ``write_slots`` ``[B, 1]``, the new ``lengths`` and ``finished``
    ``[B]`` and the number of active rows ``[]``. A finished row's query is its last token again, which
    rewrites the same slot with the same values."""
    token = logits[:, -1].argmax(dim=-1)  # [B]
    lengths, finished = append_token(tokens, lengths, finished, token, eos_table[token], end)
    index = (lengths - 1)[:, None]  # [B, 1]: the pending token
    positions = index - padding[:, None]  # [B, 1]
    slot_pos.scatter_(1, index, positions)
    slot_branch.scatter_(1, index, torch.zeros_like(index))
    return tokens.gather(1, index), positions, index, lengths, finished, finished.logical_not().sum()
