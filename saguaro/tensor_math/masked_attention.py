"""A few query rows' attention on a CPU over only the slots a mask leaves visible (``masked_attention.cpp``):
SDPA's result up to float rounding, faster (docs/measurements/2026-12-05-sd-round-on-the-cpu.md)."""

from __future__ import annotations

import torch

from saguaro.tensor_math.packed_linear import available


def masked_attention(
    q: torch.Tensor,  # [B, G, R, D] float32: the rows of each KV head's query group
    k: torch.Tensor,  # [B, G, S, D] float32
    v: torch.Tensor,  # [B, G, S, D] float32
    bias: torch.Tensor,  # [B, 1, R, S] float32 additive mask (-inf: hidden)
    scale: float,
) -> torch.Tensor:
    """``softmax(q k^T * scale + bias) v``, ``[B, G, R, D]`` (a row that sees no slot: zeros)."""
    return torch.ops.saguaro_kernels.masked_attention(q, k, v, bias, scale)


__all__ = ["available", "masked_attention"]
