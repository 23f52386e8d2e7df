"""Weight-only int8 / int4 quantization as the packed kernel's panels, and the op ``quantized_linear``:
``x`` times the weight ``float(q) * scale`` (:func:`dequantize`) whatever runs it, in aten ops (so export and
Inductor decompose it) until ``pack_linears`` rewrites it into ``saguaro_kernels::packed_linear_q``."""

from __future__ import annotations

import torch

from saguaro.tensor_math.packed_linear import PANEL, pack

QUANTIZED_BITS = {"int8": 8, "int4": 4}
DEFAULT_INT4_GROUP = 64  # k per scale for int4 (int8: one scale per output column)

_lib = torch.library.Library("saguaro", "FRAGMENT")
_lib.define("quantized_linear(Tensor x, Tensor packed, Tensor scales, int n, Tensor? bias=None) -> Tensor")


def quantize(weight: torch.Tensor, bits: int, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest ``(q [N, K] int8, scales [N, K // group] float32)`` of ``weight [N, K]``, a
    scale per ``group`` of ``k`` (None: per row): the group's largest magnitude over the top level, so ``q``
    never clips (zero group: scale 1). ``ValueError``: other bits, a group not dividing K (or odd: int4)."""
    n, k = weight.shape
    if bits not in QUANTIZED_BITS.values():
        raise ValueError(f"quantize: bits={bits!r}; allowed: {sorted(QUANTIZED_BITS.values())}")
    group = k if group is None else group
    if isinstance(group, bool) or not isinstance(group, int) or group <= 0 or k % group:
        raise ValueError(
            f"quantize: group size {group!r} does not divide the weight's width {k}; use a divisor of {k}"
        )
    if bits == 4 and group % 2:
        raise ValueError(f"quantize: an int4 group size must be even, got {group}")
    top = 127 if bits == 8 else 7
    with torch.no_grad():
        grouped = weight.detach().float().reshape(n, k // group, group)  # [N, G, group]
        peak = grouped.abs().amax(-1)  # [N, G]
        scales = torch.where(peak > 0, peak / top, torch.ones_like(peak))
        q = torch.round(grouped / scales[..., None]).clamp(-top, top).to(torch.int8)
    return q.reshape(n, k), scales.contiguous()


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight ``[N, K]`` of ``(q [N, K], scales [N, G])``: ``float(q) * scale`` rounded once."""
    n, k = q.shape
    groups = scales.shape[1]
    return (q.float().reshape(n, groups, k // groups) * scales[..., None]).reshape(n, k)


def pack_quantized(q: torch.Tensor, scales: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize`'s output as panels (layout: ``packed_weights.h``): int8 ``[P, K, 64]`` or int4 uint8
    ``[P, ceil(K/2), 64]``, and scales ``[P, G, 64]`` float32 (columns past ``N``: weight 0, scale 1)."""
    n, k = q.shape
    panels = -(-n // PANEL)
    with torch.no_grad():
        padded_scales = torch.ones(panels * PANEL, scales.shape[1], dtype=torch.float32, device=scales.device)
        padded_scales[:n] = scales
        packed_scales = padded_scales.view(panels, PANEL, -1).transpose(1, 2).contiguous()  # [P, G, 64]
        packed = pack(q)  # [P, K, 64] int8
        if bits == 4:
            unsigned = (packed.to(torch.int16) + 8).to(torch.uint8)  # 0 .. 15
            if k % 2:
                unsigned = torch.cat([unsigned, torch.full_like(unsigned[:, :1], 8)], 1)
            packed = (unsigned[:, 0::2] | (unsigned[:, 1::2] << 4)).contiguous()  # [P, ceil(K/2), 64]
    return packed, packed_scales


def unpacked_weight(packed: torch.Tensor, scales: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The float32 weight ``[n, k]`` of :func:`pack_quantized`'s ``(packed, scales)``, in aten ops."""
    if packed.dtype == torch.uint8:  # int4, two k rows a byte row
        low = (packed & 15).to(torch.int8) - 8
        high = (packed >> 4).to(torch.int8) - 8
        q = torch.stack([low, high], dim=2).reshape(packed.shape[0], -1, PANEL)[:, :k]  # [P, K, 64]
    else:
        q = packed
    groups = scales.shape[1]
    wide = (
        q.float().reshape(q.shape[0], groups, k // groups, PANEL) * scales[:, :, None, :]
    )  # [P, G, K/G, 64]
    return wide.reshape(q.shape[0], k, PANEL).transpose(1, 2).reshape(-1, k)[:n]  # [n, K]


def _quantized_linear(x, packed, scales, n, bias=None):
    k = x.shape[-1]
    weight = unpacked_weight(packed, scales, n, k)  # [n, K] float32
    out = torch.matmul(x.to(torch.float32), weight.t()).to(x.dtype)  # [..., n]
    return out if bias is None else out + bias


_lib.impl("quantized_linear", _quantized_linear, "CompositeImplicitAutograd")
quantized_linear_decomposition = (
    _quantized_linear  # the op in aten ops, for torch.export's run_decompositions
)
QUANTIZED_LINEAR = torch.ops.saguaro.quantized_linear.default


def quantized_linear(x, packed, scales, n, bias=None):
    """``x [..., K]`` times the weight ``(packed, scales)`` hold, transposed, plus ``bias``: ``[..., n]``."""
    return torch.ops.saguaro.quantized_linear(x, packed, scales, n, bias)
