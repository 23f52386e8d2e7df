"""The draft lane's work for one round: glue, fork and tree decode into a speculation cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from saguaro.runtime.fork import branch_layout
from saguaro.runtime.kv_store import KVStore
from saguaro.runtime.model_runner import ModelRunner
from saguaro.runtime.speculation_cache import SpeculationCache


@dataclass
class GlueRequest:
    """A snapshot of the speculation under verification, taken before the target commits it."""

    ids: torch.Tensor  # [B, K+1]: r, x_1..x_K
    index: torch.Tensor  # [B, K+1]: their slots
    positions: torch.Tensor  # [B, K+1]
    fan_out: list  # F_0..F_K
    temperature: float
    saguaro_c: float

    @property
    def draft_tokens(self) -> torch.Tensor:
        return self.ids[:, 1:]  # [B, K]


def tree_scratch_slots(k: int, fan_out: list) -> int:
    """Slots the tree needs after the glue: ``k`` depths of ``MQ`` branches."""
    return k * sum(fan_out)


def build_speculations(draft: ModelRunner, store: KVStore, req: GlueRequest,
                       generator: torch.Generator | None) -> SpeculationCache:
    """Glue over ``[r, x_1..x_K]``, fork top-``F_j`` candidates, and decode every branch ``K`` deep.

    Each depth is one batched draft forward over all ``MQ`` branches of all sequences. Branch ``β``
    (1-based) forked at glue row ``j`` sees shared slots up to position ``P0 + j`` and its own slots.
    """
    B, K1 = req.ids.shape
    K = K1 - 1
    device = req.ids.device
    store.invalidate_from(req.index[:, 0])  # drop last round's glue tail and tree scratch
    rows, ranks = branch_layout(req.fan_out, device)  # [MQ], [MQ]
    # the glue stage returns the fork's candidates [B, MQ] and each row's ranked tokens [B, K+1, W]
    candidates, ranked = draft.run("glue", store, req.ids, req.positions, req.index, req.draft_tokens, rows, ranks)
    MQ = rows.numel()
    if MQ == 0:  # fan-out 0: glue only; every lookup misses
        V = draft.spec.vocab_size
        return SpeculationCache(branch_rows=rows, candidates=candidates, tokens=candidates.new_zeros(B, 0, K),
                                probs=torch.zeros(B, 0, K, V, device=device), ranked=ranked)
    branch = (torch.arange(MQ, device=device) + 1).expand(B, MQ)  # [B, MQ]
    fork_pos = req.positions[:, :1] + rows[None, :]  # [B, MQ]: position of x_j, the last shared token
    first_scratch = req.index[:, -1:] + 1  # [B, 1]
    ids = candidates
    tokens, probs = [], []
    if req.temperature > 0:
        inv_t = torch.tensor(1.0 / req.temperature, device=device)
        c = torch.tensor(float(req.saguaro_c), device=device)
    for depth in range(K):
        slots = first_scratch + depth * MQ + torch.arange(MQ, device=device)[None, :]  # [B, MQ]
        position = fork_pos + 1 + depth
        if req.temperature == 0.0:
            token, prob = draft.run("tree_greedy", store, ids, position, slots, branch=branch, limit=fork_pos)
        else:
            # Saguaro sampling: this token is x_{depth+1} of the next speculation, whose recovery would
            # be looked up among the top-F_depth candidates of the next glue's row `depth`
            top = torch.tensor(req.fan_out[depth], device=device)
            u = torch.rand(B, MQ, generator=generator, device=device)
            token, prob = draft.run("tree_sampled", store, ids, position, slots, inv_t, top, c, u, branch=branch,
                                    limit=fork_pos)
        tokens.append(token)  # [B, MQ]
        probs.append(prob)  # [B, MQ, V]
        ids = token
    return SpeculationCache(
        branch_rows=rows, candidates=candidates, tokens=torch.stack(tokens, dim=2),  # [B, MQ, K]
        probs=torch.stack(probs, dim=2), ranked=ranked)  # [B, MQ, K, V]
