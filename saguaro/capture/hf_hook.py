"""Route a Hugging Face model's attention through the saguaro op via ``AttentionInterface``.

HF calls ``attention_interface(module, query, key, value, attention_mask, scaling=..., **kwargs)``
with ``query [B, H, T, D]`` and ``key/value [B, Hkv, T, D]`` after RoPE. Our implementation ignores
HF's mask (we register a mask builder that returns ``None``) and reads the KV store and the mask
description from a context variable (:data:`ACTIVE_CONTEXT`) that the capture wrapper
(``saguaro.capture.export._StageForward``) sets around the forward. Registration happens lazily, on first capture, never at import.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch

from saguaro.capture.attention_op import saguaro_attention
from saguaro.core.errors import CaptureError

ATTN_IMPLEMENTATION = "saguaro"


@dataclass
class AttentionContext:
    """What every attention layer of one forward needs besides its q/k/v."""

    k_caches: list  # per layer [B, Hkv, S, D]
    v_caches: list
    write_slots: torch.Tensor  # [B, T]
    bias: torch.Tensor  # [B, 1, G*T, S] additive mask, built once per forward


ACTIVE_CONTEXT: contextvars.ContextVar[AttentionContext] = contextvars.ContextVar("saguaro_attention_context")


def saguaro_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The ``AttentionInterface`` implementation named ``"saguaro"``."""
    if kwargs.get("softcap") is not None:
        raise CaptureError(f"{type(module).__name__}: attention logit soft-capping is not supported by saguaro")
    if kwargs.get("sinks") is not None or getattr(module, "sinks", None) is not None:
        raise CaptureError(f"{type(module).__name__}: attention sinks are not supported by saguaro")
    try:
        ctx = ACTIVE_CONTEXT.get()
    except LookupError:
        raise CaptureError(
            f"{type(module).__name__} ran with attn_implementation='saguaro' outside a saguaro capture"
        ) from None
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise CaptureError(f"{type(module).__name__} has no layer_idx; saguaro cannot map it to a KV store layer")
    # a sliding window is part of the mask, built once per forward from the model's config
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    out = saguaro_attention(query, key, value, ctx.k_caches[layer], ctx.v_caches[layer], ctx.write_slots, ctx.bias,
                            scale)  # [B, H, T, D]
    return out.transpose(1, 2), None  # HF expects [B, T, H, D]


def _no_mask(*args, **kwargs):
    return None


def register_attention() -> None:
    """Register the saguaro attention and mask functions with ``transformers`` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, saguaro_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
