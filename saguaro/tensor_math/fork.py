"""Fork and Saguaro sampling: plain tensor functions (the passes splice these same functions)."""

from __future__ import annotations

import torch


def branch_layout(fan_out: list[int], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``MQ = Σ F_j`` branches: the glue row ``j`` of each branch and its rank within the row."""
    rows = [j for j, f in enumerate(fan_out) for _ in range(f)]
    ranks = [r for f in fan_out for r in range(f)]
    return (
        torch.tensor(rows, dtype=torch.long, device=device),  # [MQ]
        torch.tensor(ranks, dtype=torch.long, device=device),
    )  # [MQ]


RANK_WIDTH = 64  # ranks beyond this are "not close"; fan-out per position is capped here too


def fork_with_ranks(
    glue_logits: torch.Tensor,  # [B, K+1, V]
    draft_tokens: torch.Tensor,  # [B, K]
    branch_rows: torch.Tensor,  # [MQ]
    branch_ranks: torch.Tensor,  # [MQ], each < width
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``draft.glue``'s fork: ``candidates [B, MQ]``, ``ranked [B, K+1, width]`` (top, draft's excluded)."""
    # functional on purpose: the traced copy spliced into draft.glue must not rely on in-place views
    speculated = torch.nn.functional.one_hot(draft_tokens, glue_logits.shape[-1]).bool()  # [B, K, V]
    excluded = torch.cat([speculated, torch.zeros_like(speculated[:, :1])], dim=1)  # [B, K+1, V]; row K: none
    masked = glue_logits.float().masked_fill(excluded, float("-inf"))
    ranked = masked.topk(width, dim=-1).indices  # [B, K+1, width]
    return ranked[:, branch_rows, branch_ranks], ranked


def ranks_from_ranked(
    ranked: torch.Tensor, accepted: torch.Tensor, outcome_tokens: torch.Tensor
) -> torch.Tensor:
    """Rank of ``r'`` in row ``a`` of ``ranked [B, K+1, W]`` (``W`` when not among the top ``W``)."""
    B, _, W = ranked.shape
    row = ranked.gather(1, accepted[:, None, None].expand(B, 1, W)).squeeze(1)  # [B, W]
    found = row == outcome_tokens[:, None]
    return torch.where(found.any(dim=1), found.long().argmax(dim=1), torch.full_like(accepted, W))


def saguaro_scaled(probs: torch.Tensor, top: torch.Tensor, c: torch.Tensor, width: int) -> torch.Tensor:
    """:func:`saguaro_distribution` with ``top`` and ``c`` as tensors (``top <= width``), for graphs."""
    idx = probs.topk(width, dim=-1).indices  # [..., width]
    keep = torch.arange(width, device=probs.device) < top  # [width]
    factor = torch.where(keep, c, torch.ones_like(c)).to(probs.dtype).expand(idx.shape)
    scaled = probs * torch.ones_like(probs).scatter(-1, idx, factor)
    return scaled / scaled.sum(dim=-1, keepdim=True)


def saguaro_distribution(probs: torch.Tensor, top: int, c: float) -> torch.Tensor:
    """Saguaro sampling ``q'``: the top-``top`` of ``probs [..., V]`` times ``c``, renormalised."""
    if c >= 1.0 or top <= 0:
        return probs
    idx = probs.topk(min(top, probs.shape[-1]), dim=-1).indices
    scale = torch.ones_like(probs).scatter_(-1, idx, c)
    scaled = probs * scale
    return scaled / scaled.sum(dim=-1, keepdim=True)
