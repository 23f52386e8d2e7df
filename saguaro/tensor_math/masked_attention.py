"""The attention of a few query rows per KV head over a KV store, on a CPU: the op
``torch.ops.saguaro_kernels.masked_attention(q [B, G, R, D], k [B, G, S, D], v [B, G, S, D], bias [B, 1, R, S],
scale) -> [B, G, R, D]`` (``masked_attention.cpp``, built with the ``saguaro_kernels`` library by
:mod:`~saguaro.tensor_math.packed_linear`).

It computes ``softmax(q k^T * scale + bias) v`` as ``scaled_dot_product_attention`` does with an additive mask,
reading only the slots the bias leaves visible (``-inf`` hides the others): decode stages attend a handful of
rows to a store of mostly unused capacity, where SDPA's CPU kernel spends the call on per-block set-up (60 us
for a verify's 6 rows over 256 slots against 15-25 us here). Equal to SDPA up to float rounding.
"""

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
    """``softmax(q k^T * scale + bias) v``: ``[B, G, R, D]`` (a row that sees no slot gets zeros)."""
    return torch.ops.saguaro_kernels.masked_attention(q, k, v, bias, scale)


__all__ = ["available", "masked_attention"]
