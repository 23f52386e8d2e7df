"""Run one captured (and lowered) model over its KV store."""

from __future__ import annotations

import torch

from saguaro.capture.export import CapturedModel
from saguaro.runtime.kv_store import KVStore


class ModelRunner:
    """A lowered model forward plus the bookkeeping every stage call shares."""

    def __init__(self, name: str, captured: CapturedModel, forward):
        self.name = name
        self.captured = captured
        self.spec = captured.spec
        self.forward = forward

    def new_store(self, batch: int, capacity: int) -> KVStore:
        return KVStore(self.spec, batch, capacity)

    def __call__(
        self,
        store: KVStore,
        input_ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T]
        write_slots: torch.Tensor,  # [B, T]
        branch: torch.Tensor | None = None,  # [B, T]; None: shared (0)
        limit: torch.Tensor | None = None,  # [B, T]; None: the query's own position
    ) -> torch.Tensor:
        if branch is None:
            branch = torch.zeros_like(positions)
        if limit is None:
            limit = positions
        store.claim(write_slots, positions, branch)
        return self.forward(input_ids, positions, write_slots, branch, limit, store.slot_pos, store.slot_branch,
                            store.k_caches, store.v_caches)  # [B, T, V]
