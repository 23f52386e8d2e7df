"""The draft lane's work for one round: glue, fork and tree decode into a speculation cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from saguaro.runtime.fork import branch_layout, fork_candidates, saguaro_distribution
from saguaro.runtime.kv_store import KVStore
from saguaro.runtime.model_runner import ModelRunner
from saguaro.runtime.speculation_cache import SpeculationCache
from saguaro.runtime.verification import probabilities


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
    glue_logits = draft(store, req.ids, req.positions, req.index)  # [B, K+1, V]
    rows, ranks = branch_layout(req.fan_out, device)  # [MQ], [MQ]
    candidates = fork_candidates(glue_logits, req.draft_tokens, rows, ranks)  # [B, MQ]
    MQ = rows.numel()
    if MQ == 0:  # fan-out 0: glue only; every lookup misses
        empty = glue_logits.new_zeros(B, 0, K, glue_logits.shape[-1])
        return SpeculationCache(branch_rows=rows, candidates=candidates, tokens=candidates.new_zeros(B, 0, K),
                                probs=empty, glue_logits=glue_logits)
    branch = (torch.arange(MQ, device=device) + 1).expand(B, MQ)  # [B, MQ]
    fork_pos = req.positions[:, :1] + rows[None, :]  # [B, MQ]: position of x_j, the last shared token
    first_scratch = req.index[:, -1:] + 1  # [B, 1]
    ids = candidates
    tokens, probs = [], []
    for depth in range(K):
        slots = first_scratch + depth * MQ + torch.arange(MQ, device=device)[None, :]  # [B, MQ]
        logits = draft(store, ids, fork_pos + 1 + depth, slots, branch=branch, limit=fork_pos)  # [B, MQ, V]
        if req.temperature == 0.0:
            token = logits.argmax(dim=-1)  # [B, MQ]
            prob = torch.softmax(logits.float(), dim=-1)
        else:
            # Saguaro sampling: this token is x_{depth+1} of the next speculation, whose recovery would
            # be looked up among the top-F_depth candidates of the next glue's row `depth`
            prob = saguaro_distribution(probabilities(logits, req.temperature), req.fan_out[depth], req.saguaro_c)
            token = torch.multinomial(prob.reshape(B * MQ, -1), 1, generator=generator).reshape(B, MQ)
        tokens.append(token)
        probs.append(prob)
        ids = token
    return SpeculationCache(
        branch_rows=rows, candidates=candidates, tokens=torch.stack(tokens, dim=2),  # [B, MQ, K]
        probs=torch.stack(probs, dim=2), glue_logits=glue_logits)  # [B, MQ, K, V]
