"""The draft's greedy step chained to the next one, spliced after the step's logits by ``splice_epilogue``
(stage ``draft.chain_greedy``): the step's token (``sampling.step_greedy``'s argmax) and the next step's
query, its slot claimed in the draft's KV store inside the graph, so that drafting ``k`` tokens is ``k``
stage calls and nothing else on the host between them (the claim, the position and slot arithmetic and the
token's reshape were eager operations of about 20 us a step on a CPU, a tenth of a small draft's step).

The claim is ``KVStore.claim``'s effect (slot ``s`` marked as holding position ``p`` on branch 0), written
in place; as in ``ar_round``, every in-place write stores a value that does not depend on the order in which
threads run it. The next slot of a row whose step wrote the store's last slot lies past the store: it is
left as it is (the store's capacity leaves room for a round's ``k + 1`` tokens, so a generation never gets
there), and the caller drops the last claim of a chain, whose token is never fed
(``draft.decode.draft_decode``)."""

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
    """The step's ``tokens [B]`` and the next step's ``input_ids``, ``positions`` and ``write_slots`` ``[B, 1]``
    (the token, the next position and the next slot), that slot claimed in the store."""
    token = step_greedy(logits)  # [B]
    next_positions = positions[:, -1:] + 1  # [B, 1]
    next_slots = write_slots[:, -1:] + 1  # [B, 1]
    inside = next_slots < slot_pos.shape[1]  # [B, 1]
    slot = next_slots.clamp_max(slot_pos.shape[1] - 1)  # [B, 1]: in bounds; a row past the end rewrites its own
    slot_pos.scatter_(1, slot, torch.where(inside, next_positions, slot_pos.gather(1, slot)))
    slot_branch.scatter_(1, slot, torch.where(inside, torch.zeros_like(slot), slot_branch.gather(1, slot)))
    return token, token[:, None], next_positions, next_slots
