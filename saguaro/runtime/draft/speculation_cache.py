"""The speculation cache: ``(sequence, j, c) → (k tokens, their draft distributions)``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SpeculationCache:
    """What one glue + fork + tree decode prepared for every outcome it predicted (shapes by field);
    ``ranked`` (each glue row's top tokens, the speculated one excluded) feeds the ``ρ`` estimate."""

    branch_rows: torch.Tensor  # [MQ]: each branch's outcome position j
    candidates: torch.Tensor  # [B, MQ]: each branch's outcome token c
    tokens: torch.Tensor  # [B, MQ, K]: the speculation that follows c
    probs: torch.Tensor | None  # [B, MQ, K, V]: what those tokens were drawn from; None when greedy
    ranked: torch.Tensor  # [B, K+1, W]
    glue_s: float = 0.0  # measured seconds of the glue that built it
    depth_s: list = field(default_factory=list)  # measured seconds of each tree depth
    keys: list | None = None  # [B] host dicts (j, c) -> branch, from :meth:`index_on_host`

    def index_on_host(self, branch_rows: list, candidates: list) -> None:
        """Index the cache on the host from ``branch_rows [MQ]`` and ``candidates [B, MQ]`` (read once, at the
        build's end), so :meth:`match_host` is host work."""
        self.keys = []
        for row in candidates:
            keys: dict = {}
            for branch, key in enumerate(zip(branch_rows, row)):
                keys.setdefault(key, branch)  # the first branch of an outcome, as :meth:`match` picks
            self.keys.append(keys)

    def match_host(self, accepted: list, outcome_tokens: list) -> tuple[list, list]:
        """:meth:`match` on host ints (``a`` None: not looked up): ``hit [B]`` and branch ``[B]`` (0 on a
        miss); ``RuntimeError`` before :meth:`index_on_host`."""
        if self.keys is None:
            raise RuntimeError("match_host needs the cache indexed on the host first (index_on_host)")
        branch = [
            None if a is None else keys.get((a, c)) for keys, a, c in zip(self.keys, accepted, outcome_tokens)
        ]
        return [m is not None for m in branch], [m or 0 for m in branch]

    def match(
        self, accepted: torch.Tensor, outcome_tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For device outcomes ``(a [B], r' [B])``: ``hit [B]`` bool and the matching branch ``[B]``."""
        if self.candidates.shape[1] == 0:  # no tree this round
            return torch.zeros_like(accepted, dtype=torch.bool), torch.zeros_like(accepted)
        same = (self.branch_rows[None, :] == accepted[:, None]) & (self.candidates == outcome_tokens[:, None])
        return same.any(dim=1), same.long().argmax(dim=1)

    def speculation(self, branch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The cached ``tokens [B, K]`` and ``probs [B, K, V]`` of branch ``branch [B]`` of each row."""
        B, MQ, K = self.tokens.shape
        if MQ == 0:
            return self.tokens.new_zeros(B, K), None if self.probs is None else self.probs.new_zeros(
                B, K, self.probs.shape[-1]
            )
        tokens = self.tokens.gather(1, branch[:, None, None].expand(B, 1, K)).squeeze(1)
        if self.probs is None:
            return tokens, None
        V = self.probs.shape[-1]
        probs = self.probs.gather(1, branch[:, None, None, None].expand(B, 1, K, V)).squeeze(1)
        return tokens, probs
