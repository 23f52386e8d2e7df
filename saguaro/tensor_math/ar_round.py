"""AR's greedy round after the step (``target.round_greedy``) and its append (eager: ``append_one``)."""

from __future__ import annotations

import torch

# Inductor's C++ kernels may run a one-element statement on every thread of a parallel region, so every
# in-place write here stores a value that does not depend on what it overwrites or on the threads' order,
# and the new lengths and finished are returned, never written over their inputs (``lengths += 1`` raced:
# wrong tokens at two threads).


def append_token(
    tokens: torch.Tensor,  # [B, S] token buffer, written in place
    lengths: torch.Tensor,  # [B] long
    finished: torch.Tensor,  # [B] bool
    token: torch.Tensor,  # [B] one new token per row
    is_eos: torch.Tensor,  # [B] bool: whether each token is an EOS token
    end: torch.Tensor | int,  # the length at which a row has its max_new_tokens ([] long, or an int)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Append ``token`` to each active row (not finished, shorter than ``end``), in ``tokens`` in place; a row
    finishes at an EOS (kept) or at ``end``. Returns the new ``lengths [B]`` and ``finished [B]``."""
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
    """The argmax appended, then the pending token's slot claimed as ``KVStore.claim`` would. Returns the
    next ``input_ids``, ``positions``, ``write_slots [B, 1]``, ``lengths``, ``finished [B]``, active rows."""
    token = logits[:, -1].argmax(dim=-1)  # [B]
    lengths, finished = append_token(tokens, lengths, finished, token, eos_table[token], end)
    index = (lengths - 1)[:, None]  # [B, 1]: the pending token (a finished row's last: rewritten as it was)
    positions = index - padding[:, None]  # [B, 1]
    slot_pos.scatter_(1, index, positions)
    slot_branch.scatter_(1, index, torch.zeros_like(index))
    return tokens.gather(1, index), positions, index, lengths, finished, finished.logical_not().sum()
