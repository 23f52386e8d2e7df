"""``draft.chain_greedy``: a step and the next one's query, so k drafted tokens are k stage calls and no host
work (docs/measurements/2026-12-06-draft-chain.md)."""

from __future__ import annotations

import torch

from saguaro.tensor_math.sampling import step_greedy


def chain_greedy(
    logits: torch.Tensor,  # [B, T, V] the step's
    positions: torch.Tensor,  # [B, T] the step's query positions
    write_slots: torch.Tensor,  # [B, T] the slots the step wrote
    slot_pos: torch.Tensor,  # [B, S] the KV store's slot positions, written in place
    slot_branch: torch.Tensor,  # [B, S] its slot branches, written in place
):
    """The step's ``tokens [B]`` and the next ``input_ids``, ``positions``, ``write_slots [B, 1]``, that slot
    claimed as ``KVStore.claim`` would (branch 0; writes independent of thread order, as in ar_round)."""
    token = step_greedy(logits)  # [B]
    next_positions = positions[:, -1:] + 1  # [B, 1]
    next_slots = write_slots[:, -1:] + 1  # [B, 1]
    inside = next_slots < slot_pos.shape[1]  # [B, 1]
    # [B, 1] in bounds: a row past the store's end (never reached: capacity holds a round's k + 1 tokens)
    # rewrites its own slot, and draft_decode drops a chain's last claim, whose token is never fed
    slot = next_slots.clamp_max(slot_pos.shape[1] - 1)
    slot_pos.scatter_(1, slot, torch.where(inside, next_positions, slot_pos.gather(1, slot)))
    slot_branch.scatter_(1, slot, torch.where(inside, torch.zeros_like(slot), slot_branch.gather(1, slot)))
    return token, token[:, None], next_positions, next_slots
