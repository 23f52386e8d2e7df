"""The KV store Saguaro owns: preallocated per-layer caches plus slot metadata.

Slot ``i`` of row ``b`` holds token ``i`` of that row's token buffer (left padding included), so a
token's slot equals its index; tree scratch slots follow the glue. ``slot_pos`` is -1 for empty,
padding and rolled-back slots; ``slot_branch`` is 0 for shared slots, ``β`` for tree branch ``β``.
"""

from __future__ import annotations

import torch

from saguaro.capture.export import ModelSpec


class KVStore:
    """Per-layer caches ``[B, Hkv, S, D]`` and the mask description of their slots."""

    def __init__(self, spec: ModelSpec, batch: int, capacity: int):
        shape = (batch, spec.num_kv_heads, capacity, spec.head_dim)
        dev = spec.device
        self.k_caches = [torch.zeros(shape, dtype=spec.dtype, device=dev) for _ in range(spec.num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=spec.dtype, device=dev) for _ in range(spec.num_layers)]
        self.slot_pos = torch.full((batch, capacity), -1, dtype=torch.long, device=dev)  # [B, S]
        self.slot_branch = torch.zeros(batch, capacity, dtype=torch.long, device=dev)  # [B, S]
        self.capacity = capacity
        self._slot_index = torch.arange(capacity, device=dev)  # [S]

    def claim(self, write_slots: torch.Tensor, positions: torch.Tensor, branch: torch.Tensor) -> None:
        """Mark ``write_slots [B, T]`` as holding tokens at ``positions`` on ``branch`` (all ``[B, T]``)."""
        self.slot_pos.scatter_(1, write_slots, positions)
        self.slot_branch.scatter_(1, write_slots, branch)

    def invalidate_from(self, lengths: torch.Tensor) -> None:
        """Roll back by length: slots ``>= lengths[b]`` of row ``b`` become empty (``lengths [B]``)."""
        beyond = self._slot_index[None, :] >= lengths[:, None]  # [B, S]
        self.slot_pos.masked_fill_(beyond, -1)
        self.slot_branch.masked_fill_(beyond, 0)

    def select_rows(self, rows: torch.Tensor) -> "KVStore":
        """A copy of the store restricted to ``rows [M]`` (caches and slot metadata)."""
        sub = KVStore.__new__(KVStore)
        sub.k_caches = [c.index_select(0, rows) for c in self.k_caches]
        sub.v_caches = [c.index_select(0, rows) for c in self.v_caches]
        sub.slot_pos = self.slot_pos.index_select(0, rows)
        sub.slot_branch = self.slot_branch.index_select(0, rows)
        sub.capacity = self.capacity
        sub._slot_index = self._slot_index
        return sub
