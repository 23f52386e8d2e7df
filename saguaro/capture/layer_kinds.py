"""Each layer's attention kind from a Hugging Face config: a sliding window (positions ``> q - window``, as
``sliding_window_overlay``) or a chunk (``pos // chunk`` the query's, as ``chunked_overlay``), or full.

Read from ``config.layer_types`` (:data:`FULL`, :data:`SLIDING`, :data:`CHUNKED`); without it every layer
gets one kind, ``sliding_window`` (unless ``use_sliding_window`` is off) or full."""

from __future__ import annotations

from dataclasses import dataclass

from saguaro.core.errors import CaptureError

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"


@dataclass(frozen=True, order=True)
class LayerKind:
    """One layer's mask rule on top of causality: ``window`` and ``chunk`` are 0 when unused."""

    window: int = 0
    chunk: int = 0

    def __str__(self) -> str:
        if self.window:
            return f"sliding({self.window})"
        return f"chunked({self.chunk})" if self.chunk else "full"


def layer_kinds(config, num_layers: int) -> tuple[LayerKind, ...]:
    """The kind of every layer, or ``CaptureError`` naming the config class and what is not supported."""
    name = type(config).__name__
    if getattr(config, "use_bidirectional_attention", False):
        raise CaptureError(
            f"{name}: use_bidirectional_attention=True is not causal; saguaro needs causal attention"
        )
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    types = getattr(config, "layer_types", None)
    if not types:
        return (LayerKind(window=int(window)) if window else LayerKind(),) * num_layers
    if len(types) < num_layers:
        raise CaptureError(f"{name}: layer_types names {len(types)} layers, the model has {num_layers}")
    kinds = []
    for i, kind in enumerate(types[:num_layers]):
        if kind == FULL:
            kinds.append(LayerKind())
        elif kind == SLIDING:
            if not window:  # transformers' own sliding mask refuses this too
                raise CaptureError(
                    f"{name}: layer {i} is sliding_attention but the config has no sliding window "
                    f"(sliding_window={getattr(config, 'sliding_window', None)!r}, "
                    f"use_sliding_window={getattr(config, 'use_sliding_window', None)!r})"
                )
            kinds.append(LayerKind(window=int(window)))
        elif kind == CHUNKED:
            chunk = getattr(config, "attention_chunk_size", None)
            if not chunk:
                raise CaptureError(
                    f"{name}: layer {i} is chunked_attention but attention_chunk_size={chunk!r}"
                )
            kinds.append(LayerKind(chunk=int(chunk)))
        else:
            raise CaptureError(
                f"{name}: layer {i} has attention kind {kind!r}; saguaro supports {FULL!r}, "
                f"{SLIDING!r} and {CHUNKED!r}"
            )
    return tuple(kinds)
