"""Fork and Saguaro sampling: plain tensor functions (the passes splice these same functions)."""

from __future__ import annotations

import torch


def branch_layout(fan_out: list[int], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``MQ = Σ F_j`` branches: the glue row ``j`` of each branch and its rank within the row."""
    rows = [j for j, f in enumerate(fan_out) for _ in range(f)]
    ranks = [r for f in fan_out for r in range(f)]
    return (torch.tensor(rows, dtype=torch.long, device=device),  # [MQ]
            torch.tensor(ranks, dtype=torch.long, device=device))  # [MQ]


def fork_candidates(
    glue_logits: torch.Tensor,  # [B, K+1, V]: row j is the draft's distribution after x_j
    draft_tokens: torch.Tensor,  # [B, K]: x_1..x_K of the speculation being verified
    branch_rows: torch.Tensor,  # [MQ]
    branch_ranks: torch.Tensor,  # [MQ]
) -> torch.Tensor:
    """Candidate outcome tokens ``[B, MQ]``: the top-``F_j`` of row ``j``, excluding ``x_{j+1}``.

    A rejected token is never the recovery token, so ``x_{j+1}`` is removed from row ``j < K``.
    """
    B, rows, V = glue_logits.shape
    K = rows - 1
    masked = glue_logits.float().clone()
    masked[:, :K].scatter_(2, draft_tokens[:, :, None], float("-inf"))
    if branch_rows.numel() == 0:
        return draft_tokens.new_zeros(B, 0)
    width = int(branch_ranks.max()) + 1
    top = masked.topk(min(width, V), dim=-1).indices  # [B, K+1, width]
    return top[:, branch_rows, branch_ranks]  # [B, MQ]


def candidate_ranks(
    glue_logits: torch.Tensor,  # [B, K+1, V]
    draft_tokens: torch.Tensor,  # [B, K]
    accepted: torch.Tensor,  # [B]
    outcome_tokens: torch.Tensor,  # [B]
) -> torch.Tensor:
    """Rank of ``r'`` among row ``a``'s candidates (0 = the top candidate), ``[B]``."""
    B, rows, V = glue_logits.shape
    row = glue_logits.float().gather(1, accepted[:, None, None].expand(B, 1, V)).squeeze(1)  # [B, V]
    K = rows - 1
    excluded = torch.where(accepted < K, draft_tokens.gather(1, accepted.clamp_max(K - 1)[:, None]).squeeze(1),
                           torch.full_like(accepted, -1))
    value = row.gather(1, outcome_tokens[:, None])  # [B, 1]
    above = row > value
    above.scatter_(1, excluded.clamp_min(0)[:, None], False)  # the excluded token holds no rank
    return above.sum(dim=1)


def saguaro_distribution(probs: torch.Tensor, top: int, c: float) -> torch.Tensor:
    """Saguaro sampling ``q'``: the top-``top`` probabilities of ``probs [..., V]`` times ``c``, renormalised.

    The residual ``max(0, p − q')`` then concentrates on the cached (top) tokens.
    """
    if c >= 1.0 or top <= 0:
        return probs
    idx = probs.topk(min(top, probs.shape[-1]), dim=-1).indices
    scale = torch.ones_like(probs).scatter_(-1, idx, c)
    scaled = probs * scale
    return scaled / scaled.sum(dim=-1, keepdim=True)
