"""The stages' logits epilogues (``splice_epilogue``): what leaves each graph instead of all its logits."""

from __future__ import annotations

import torch

from saguaro.tensor_math.fork import saguaro_scaled
from saguaro.tensor_math.verification import sample_inverse_cdf


def last_logits(logits: torch.Tensor) -> torch.Tensor:
    """Prefill and AR step: only the last position's logits ``[B, V]`` leave the graph."""
    return logits[:, -1]


def all_logits(logits: torch.Tensor) -> torch.Tensor:
    """``target.verify_logits`` and ``target.score``: every position's logits leave the graph."""
    return logits


def step_greedy(logits: torch.Tensor) -> torch.Tensor:
    """``draft.step`` at temperature 0: the next token ``[B]``."""
    return logits[:, -1].argmax(dim=-1)


def step_sampled(logits: torch.Tensor, inv_temperature: torch.Tensor, u: torch.Tensor):
    """``draft.step`` at temperature > 0: a token ``[B]`` drawn with ``u [B]`` and its ``q [B, V]``."""
    probs = torch.softmax(logits[:, -1].float() * inv_temperature, dim=-1)
    return sample_inverse_cdf(probs, u), probs


def tree_greedy(logits: torch.Tensor) -> torch.Tensor:
    """``draft.tree`` at temperature 0: tokens ``[B, MQ]`` (greedy verification needs no distribution)."""
    return logits.argmax(dim=-1)


def tree_sampled(
    logits: torch.Tensor,
    inv_temperature: torch.Tensor,
    top: torch.Tensor,
    c: torch.Tensor,
    u: torch.Tensor,
    width: int,
):
    """``draft.tree`` at temperature > 0: tokens by ``u [B, MQ]`` from Saguaro's ``q' [B, MQ, V]``, and q'."""
    probs = torch.softmax(logits.float() * inv_temperature, dim=-1)
    scaled = saguaro_scaled(probs, top, c, width)
    return sample_inverse_cdf(scaled, u), scaled
