"""The speculation cache: ``(sequence, j, c) → (k tokens, their draft distributions)``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SpeculationCache:
    """What one glue + fork + tree decode prepared for every outcome it predicted.

    ``branch_rows [MQ]`` is the outcome position ``j`` of each branch, ``candidates [B, MQ]`` its
    outcome token ``c``; ``tokens [B, MQ, K]`` the speculation that follows ``c`` and
    ``probs [B, MQ, K, V]`` the distributions those tokens were drawn from (``None`` when greedy). ``ranked`` (each glue
    row's top tokens, speculated token excluded) feeds the online ``ρ`` estimate.
    """

    branch_rows: torch.Tensor  # [MQ]
    candidates: torch.Tensor  # [B, MQ]
    tokens: torch.Tensor  # [B, MQ, K]
    probs: torch.Tensor | None  # [B, MQ, K, V]
    ranked: torch.Tensor  # [B, K+1, W]
    glue_s: float = 0.0  # measured seconds of the glue that built it
    depth_s: list = field(default_factory=list)  # measured seconds of each tree depth

    def match(self, accepted: torch.Tensor, outcome_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For outcomes ``(a [B], r' [B])``: ``hit [B]`` bool and the matching branch ``[B]``."""
        if self.candidates.shape[1] == 0:  # no tree this round
            return torch.zeros_like(accepted, dtype=torch.bool), torch.zeros_like(accepted)
        same = (self.branch_rows[None, :] == accepted[:, None]) & (self.candidates == outcome_tokens[:, None])
        return same.any(dim=1), same.long().argmax(dim=1)

    def speculation(self, branch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The cached ``tokens [B, K]`` and ``probs [B, K, V]`` of branch ``branch [B]`` of each row."""
        B, MQ, K = self.tokens.shape
        if MQ == 0:
            return self.tokens.new_zeros(B, K), None if self.probs is None else self.probs.new_zeros(B, K,
                                                                                                   self.probs.shape[-1])
        tokens = self.tokens.gather(1, branch[:, None, None].expand(B, 1, K)).squeeze(1)
        if self.probs is None:
            return tokens, None
        V = self.probs.shape[-1]
        probs = self.probs.gather(1, branch[:, None, None, None].expand(B, 1, K, V)).squeeze(1)
        return tokens, probs
