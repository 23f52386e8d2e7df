"""Capture a Hugging Face causal LM into an FX ``GraphModule`` through ``torch.export``.

The captured graph takes ``(input_ids [B, T], positions [B, T], write_slots [B, T],
query_branch [B, T], query_limit [B, T], slot_pos [B, S], slot_branch [B, S], k_caches, v_caches)``
and returns ``logits [B, T, V]``. Batch, query length and store capacity are dynamic dimensions, so
one capture serves every stage; each layer's attention is one ``saguaro::attention`` node that
mutates its layer of the KV store in place (export's training IR keeps the mutation).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from saguaro.capture import capture_files
from saguaro.capture.attention_op import ATTENTION_OPS, saguaro_attention_mask
from saguaro.capture.capture_cache import CAPTURES, fingerprint
from saguaro.capture.hf_hook import (
    ACTIVE_CONTEXT,
    ATTN_IMPLEMENTATION,
    AttentionContext,
    register_attention,
    softcap_dropped_by,
)
from saguaro.capture.layer_kinds import LayerKind, layer_kinds
from saguaro.core.errors import CaptureError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    """What the runtime needs to know about a captured model."""

    model_class: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    dtype: torch.dtype
    device: torch.device
    layer_kinds: tuple[LayerKind, ...] = ()  # per layer: its sliding window / chunk (all zero: full)


class _StageForward(torch.nn.Module):
    """Wraps an HF model so its forward has the captured graph's signature."""

    def __init__(self, model: torch.nn.Module, spec: ModelSpec, drop_softcap: bool = False):
        super().__init__()
        self.model = model
        self.drop_softcap = drop_softcap
        self.groups = spec.num_heads // spec.num_kv_heads
        self.layer_kinds = spec.layer_kinds

    def forward(
        self,
        input_ids,
        positions,
        write_slots,
        query_branch,
        query_limit,
        slot_pos,
        slot_branch,
        k_caches,
        v_caches,
    ):
        biases = {  # one mask per distinct layer kind, each [B, 1, G*T, S]
            kind: saguaro_attention_mask(
                write_slots,
                positions,
                query_branch,
                query_limit,
                slot_pos,
                slot_branch,
                kind.window,
                kind.chunk,
                self.groups,
                k_caches[0].dtype,
            )
            for kind in sorted(set(self.layer_kinds))
        }
        ctx = AttentionContext(
            list(k_caches), list(v_caches), write_slots, biases, self.layer_kinds, self.drop_softcap
        )
        token = ACTIVE_CONTEXT.set(ctx)
        try:
            out = self.model(input_ids=input_ids, position_ids=positions, use_cache=False)
        finally:
            ACTIVE_CONTEXT.reset(token)
        return out.logits  # [B, T, V]


@dataclass
class CapturedModel:
    """An exported model: its graph (the signature in this module's docstring) and its spec."""

    graph_module: torch.fx.GraphModule
    spec: ModelSpec


def model_spec(model: torch.nn.Module) -> ModelSpec:
    """Read the shapes Saguaro needs from an HF causal LM, or raise ``CaptureError`` naming the class."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "get_output_embeddings"):
        raise CaptureError(f"{name} is not a Hugging Face causal LM (no config / output embeddings)")
    if model.get_output_embeddings() is None:
        raise CaptureError(f"{name} has no language-model head; pass an *ForCausalLM model")
    if getattr(config, "is_encoder_decoder", False):
        raise CaptureError(f"{name} is an encoder-decoder model; saguaro needs a decoder-only causal LM")
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    param = next(model.parameters())
    return ModelSpec(
        model_class=name,
        num_layers=text_config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(text_config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        vocab_size=model.get_output_embeddings().weight.shape[0],
        max_positions=_max_positions(text_config),
        dtype=param.dtype,
        device=param.device,
        layer_kinds=layer_kinds(text_config, text_config.num_hidden_layers),
    )


def _max_positions(config) -> int:
    """The most positions the captured graph computes exactly: below ``floor_scale`` for Llama 4's NoPE
    layers, whose query scale counts ``p`` from an HF cache a captured forward has not got."""
    limit = getattr(config, "max_position_embeddings", None) or 1 << 20
    nope_layers = 0 in (getattr(config, "no_rope_layers", None) or [])
    if getattr(config, "attn_temperature_tuning", False) and nope_layers:
        limit = min(limit, int(config.floor_scale) - 1)
    return limit


def example_inputs(spec: ModelSpec, batch: int = 2, tokens: int = 3, slots: int = 8):
    """Inputs of the right dtypes and devices, used to trace the graph."""
    dev = spec.device
    ids = torch.zeros(batch, tokens, dtype=torch.long, device=dev)
    pos = torch.arange(tokens, device=dev).expand(batch, tokens).contiguous()
    zeros_q = torch.zeros(batch, tokens, dtype=torch.long, device=dev)
    slot_pos = torch.full((batch, slots), -1, dtype=torch.long, device=dev)
    slot_branch = torch.zeros(batch, slots, dtype=torch.long, device=dev)
    kv_shape = (batch, spec.num_kv_heads, slots, spec.head_dim)
    k = [torch.zeros(kv_shape, dtype=spec.dtype, device=dev) for _ in range(spec.num_layers)]
    v = [torch.zeros(kv_shape, dtype=spec.dtype, device=dev) for _ in range(spec.num_layers)]
    return (ids, pos, pos.clone(), zeros_q, pos.clone(), slot_pos, slot_branch, k, v)


def _dynamic_shapes(num_layers: int):
    B = torch.export.Dim("batch", min=1, max=1 << 16)
    T = torch.export.Dim("tokens", min=1, max=1 << 16)
    S = torch.export.Dim("slots", min=2, max=1 << 17)
    q = {0: B, 1: T}
    s = {0: B, 1: S}
    kv = [{0: B, 2: S} for _ in range(num_layers)]
    return (q, q, q, q, q, s, s, kv, list(kv))


def _switch_attention(model: torch.nn.Module, implementation: str) -> None:
    model.config._attn_implementation_internal = implementation
    for sub in getattr(model.config, "sub_configs", {}) or {}:
        sub_config = getattr(model.config, sub, None)
        if sub_config is not None:
            sub_config._attn_implementation_internal = implementation


def capture(model: torch.nn.Module) -> CapturedModel:
    """Export ``model`` with saguaro attention; raise ``CaptureError`` naming the class and reason."""
    spec = model_spec(model)
    name = spec.model_class
    can_set = getattr(model, "_can_set_attn_implementation", None)
    if not getattr(model, "_supports_attention_backend", False) or (callable(can_set) and not can_set()):
        raise CaptureError(
            f"{name} does not route attention through transformers' AttentionInterface; saguaro supports models "
            "that do (Llama, Qwen2, Qwen3, Mistral, Gemma 2 / 3, GPT-OSS, Llama 4, ...)"
        )
    register_attention()
    drop_softcap = softcap_dropped_by(model)  # before the switch: what the model computes as loaded
    key = fingerprint(model, drop_softcap)
    reused = _reused(key, _StageForward(model, spec, drop_softcap), name)
    if reused is not None:
        return CapturedModel(graph_module=reused, spec=spec)
    previous = model.config._attn_implementation
    was_training = model.training
    model.eval()
    _switch_attention(model, ATTN_IMPLEMENTATION)
    start = time.perf_counter()
    try:
        with torch.no_grad():
            program = torch.export.export(
                _StageForward(model, spec, drop_softcap),
                example_inputs(spec),
                dynamic_shapes=_dynamic_shapes(spec.num_layers),
                strict=False,
            )
    except CaptureError:
        raise
    except Exception as exc:  # export failures carry long traces; name the model and the first line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CaptureError(f"torch.export could not capture {name}: {first}") from exc
    finally:
        _switch_attention(model, previous)
        model.train(was_training)
    graph_module = program.module()
    attention_nodes = [
        n for n in graph_module.graph.nodes if n.op == "call_function" and n.target in ATTENTION_OPS
    ]
    if len(attention_nodes) != spec.num_layers:
        raise CaptureError(
            f"{name}: expected one saguaro attention node per layer ({spec.num_layers}), found "
            f"{len(attention_nodes)}; some attention does not go through AttentionInterface"
        )
    CAPTURES.put(key, graph_module)
    capture_files.write(key, graph_module)
    elapsed = time.perf_counter() - start
    log.info(
        "captured %s: %d layers, %d graph nodes in %.1fs",
        name,
        spec.num_layers,
        len(graph_module.graph.nodes),
        elapsed,
    )
    return CapturedModel(graph_module=graph_module, spec=spec)


def _reused(key, wrapper: _StageForward, name: str) -> torch.fx.GraphModule | None:
    """An earlier capture bound to ``wrapper``'s weights: a template, else from disk (then a template)."""
    graph_module = CAPTURES.get(key, wrapper)
    if graph_module is not None:
        log.info("captured %s: reused this process's capture of the architecture, bound to its weights", name)
        return graph_module
    graph_module = capture_files.read(key, wrapper)
    if graph_module is not None:
        log.info(
            "captured %s: read the architecture's capture from %s, bound to its weights",
            name,
            capture_files.cache_root(),
        )
        CAPTURES.put(key, graph_module)
    return graph_module
