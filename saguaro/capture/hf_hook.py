"""A Hugging Face model's attention routed through the saguaro ops by ``AttentionInterface``.

HF's mask is ignored (the registered mask builder returns None); the KV store and masks come from
:data:`ACTIVE_CONTEXT`, which the capture wrapper sets around the forward. Registered at first capture."""

from __future__ import annotations

import contextvars
import functools
import logging
from dataclasses import dataclass

import torch

from saguaro.capture.attention_op import saguaro_attention, saguaro_attention_variants
from saguaro.core.errors import CaptureError

ATTN_IMPLEMENTATION = "saguaro"
log = logging.getLogger(__name__)


@dataclass
class AttentionContext:
    """What every attention layer of one forward needs besides its q/k/v."""

    k_caches: list  # per layer [B, Hkv, S, D]
    v_caches: list
    write_slots: torch.Tensor  # [B, T]
    biases: dict  # LayerKind -> [B, 1, G*T, S] additive mask, built once per forward per kind
    layer_kinds: tuple  # per layer: its LayerKind
    drop_softcap: bool = False  # the model as loaded computes without its softcap (see sdpa_drops_softcap)


ACTIVE_CONTEXT: contextvars.ContextVar[AttentionContext] = contextvars.ContextVar("saguaro_attention_context")


def saguaro_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The ``"saguaro"`` attention: ``query [B, H, T, D]``, ``key``/``value [B, Hkv, T, D]`` after RoPE, with
    HF's ``scaling``, ``softcap``, sinks (``s_aux``); ``CaptureError`` where a layer does not fit its kind."""
    name = type(module).__name__
    try:
        ctx = ACTIVE_CONTEXT.get()
    except LookupError:
        raise CaptureError(
            f"{name} ran with attn_implementation='saguaro' outside a saguaro capture"
        ) from None
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise CaptureError(f"{name} has no layer_idx; saguaro cannot map it to a KV store layer")
    if getattr(module, "is_causal", True) is False:
        raise CaptureError(f"{name} (layer {layer}) is not causal; saguaro supports causal attention only")
    kind = ctx.layer_kinds[layer]
    window = kwargs.get("sliding_window")
    if window is not None and int(window) != kind.window:  # the config and the layer disagree: refuse
        raise CaptureError(
            f"{name} (layer {layer}) attends with sliding_window={window}, but its config gives "
            f"the layer the kind {kind}"
        )
    sinks = kwargs.get("s_aux", kwargs.get("sinks"))  # [H]
    if sinks is None and isinstance(getattr(module, "sinks", None), torch.Tensor):
        raise CaptureError(
            f"{name} (layer {layer}) has attention sinks that its attention call does not pass; "
            "saguaro cannot tell how they apply"
        )
    if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
        raise CaptureError(
            f"{name} (layer {layer}): attention sinks of shape {tuple(sinks.shape)}; saguaro "
            f"supports one sink logit per head ({query.shape[1]})"
        )
    softcap = 0.0 if ctx.drop_softcap else float(kwargs.get("softcap") or 0.0)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    args = (
        query,
        key,
        value,
        ctx.k_caches[layer],
        ctx.v_caches[layer],
        ctx.write_slots,
        ctx.biases[kind],
        scale,
    )
    if softcap or sinks is not None:
        out = saguaro_attention_variants(*args, softcap, sinks)  # [B, H, T, D]
    else:
        out = saguaro_attention(*args)  # [B, H, T, D]
    return out.transpose(1, 2), None  # HF expects [B, T, H, D]


@functools.cache
def sdpa_drops_softcap() -> bool:
    """Whether this ``transformers``' SDPA attention silently ignores a ``softcap`` (tried on tiny tensors:
    some releases, such as 5.17, let Gemma 2 default to SDPA without it; capture then follows the model)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = torch.nn.Module()
    module.is_causal = True
    q = torch.linspace(-4.0, 4.0, 16).reshape(1, 1, 4, 4)  # [B, H, T, D]: logits far past a softcap of 1
    try:
        plain, _ = sdpa_attention_forward(module, q, q, q, None, scaling=1.0)
        capped, _ = sdpa_attention_forward(module, q, q, q, None, scaling=1.0, softcap=1.0)
    except Exception:
        return False
    return torch.equal(plain, capped)


def softcap_dropped_by(model: torch.nn.Module) -> bool:
    """True when ``model``, as loaded, attends with SDPA that ignores the softcap its config asks for."""
    config = model.config
    if not getattr(config, "attn_logit_softcapping", None) or config._attn_implementation != "sdpa":
        return False
    if not sdpa_drops_softcap():
        return False
    log.warning(
        "%s: transformers %s's SDPA attention ignores attn_logit_softcapping=%s, so the model as loaded "
        "(attn_implementation='sdpa') computes without it; Saguaro does the same, to give that model's "
        "tokens (load it with attn_implementation='eager' for the softcapped model)",
        type(model).__name__,
        _transformers_version(),
        config.attn_logit_softcapping,
    )
    return True


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _no_mask(*args, **kwargs):
    return None


def register_attention() -> None:
    """Register the saguaro attention and mask functions with ``transformers`` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, saguaro_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
