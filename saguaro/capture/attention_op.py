"""The saguaro attention ops: a layer writes its new keys and values into Saguaro's KV store, then attends.

The mask is built in the graph once per forward and layer kind, from ``slot_pos [B, S]`` (a slot's position;
-1: empty, padding or rolled back), ``slot_branch [B, S]`` (0: committed prefix and glue; tree branch β > 0),
``query_pos``, ``query_branch`` (0 or β) and ``query_limit [B, T]`` (the last shared position a query sees:
its own, or its branch's fork point ``P0 + j``). Query ``t`` sees slot ``s`` when the slot is valid and is
shared up to the limit or on the query's branch up to the query, and the layer kind allows its position; a
query always sees its own slot, so a padding query stays finite. Softcap (``tanh(x / c) * c`` before the
mask) and sinks (a logit per head in the softmax, then dropped) take ``saguaro::attention_variants``.
"""

from __future__ import annotations

import copy

import torch

OP_NAMESPACE = "saguaro"


def build_attention_mask(
    write_slots: torch.Tensor,  # [B, T] long
    query_pos: torch.Tensor,  # [B, T] long
    query_branch: torch.Tensor,  # [B, T] long
    query_limit: torch.Tensor,  # [B, T] long
    slot_pos: torch.Tensor,  # [B, S] long
    slot_branch: torch.Tensor,  # [B, S] long
    window: int,
    chunk: int = 0,
) -> torch.Tensor:
    """Boolean mask ``[B, T, S]``: True where query ``t`` may attend to slot ``s``."""
    s_pos = slot_pos[:, None, :]  # [B, 1, S]
    s_branch = slot_branch[:, None, :]  # [B, 1, S]
    valid = s_pos >= 0
    shared = (s_branch == 0) & (s_pos <= query_limit[:, :, None])
    own = (s_branch == query_branch[:, :, None]) & (s_pos <= query_pos[:, :, None])
    allowed = kind_allows(valid & (shared | own), s_pos, query_pos[:, :, None], window, chunk)
    slots = torch.arange(slot_pos.shape[1], device=slot_pos.device)  # [S]
    return allowed | (slots[None, None, :] == write_slots[:, :, None])  # [B, T, S]


def kind_allows(allowed, s_pos, q_pos, window: int, chunk: int):
    """``allowed`` narrowed to slot positions ``> q_pos - window`` and in ``q_pos``'s chunk (0: no limit), as
    broadcast: ``[B, T, S]`` from ``[B, 1, S]`` slots and ``[B, T, 1]`` queries, or scalars."""
    if window > 0:
        allowed = allowed & (s_pos > q_pos - window)
    if chunk > 0:
        allowed = allowed & (
            torch.div(s_pos, chunk, rounding_mode="floor") == torch.div(q_pos, chunk, rounding_mode="floor")
        )
    return allowed


def causal_bias(
    write_slots: torch.Tensor,  # [B, T]
    query_pos: torch.Tensor,  # [B, T]
    slot_pos: torch.Tensor,  # [B, S]
    slot_branch: torch.Tensor,  # [B, S]
    window: int,
    groups: int,
    dtype: torch.dtype,
    chunk: int = 0,
) -> torch.Tensor:
    """The causal stages' mask: shared slots up to the query's position (their queries are all shared)."""
    s_pos = slot_pos[:, None, :]  # [B, 1, S]
    allowed = (s_pos >= 0) & (slot_branch[:, None, :] == 0) & (s_pos <= query_pos[:, :, None])
    allowed = kind_allows(allowed, s_pos, query_pos[:, :, None], window, chunk)  # [B, T, S]
    slots = torch.arange(slot_pos.shape[1], device=slot_pos.device)  # [S]
    allowed = allowed | (slots[None, None, :] == write_slots[:, :, None])  # [B, T, S]
    return additive_mask(allowed, groups, dtype)


def tree_bias(
    write_slots: torch.Tensor,  # [B, MQ]
    query_pos: torch.Tensor,  # [B, MQ]
    query_branch: torch.Tensor,  # [B, MQ]: branch β of each query (1-based)
    query_limit: torch.Tensor,  # [B, MQ]: fork point P0 + j of its branch
    slot_pos: torch.Tensor,  # [B, S]
    slot_branch: torch.Tensor,  # [B, S]
    window: int,
    groups: int,
    dtype: torch.dtype,
    chunk: int = 0,
) -> torch.Tensor:
    """The tree mask: the shared slots up to the fork point, then the branch's own earlier tree tokens."""
    mask = build_attention_mask(
        write_slots, query_pos, query_branch, query_limit, slot_pos, slot_branch, window, chunk
    )
    return additive_mask(mask, groups, dtype)


def additive_mask(mask: torch.Tensor, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, T, S]`` bool → ``[B, 1, G*T, S]`` additive float mask for query groups folded into rows."""
    B, T, S = mask.shape
    bias = torch.zeros_like(mask, dtype=dtype).masked_fill_(~mask, float("-inf"))
    return bias[:, None, None].expand(B, 1, groups, T, S).reshape(B, 1, groups * T, S)


def attention_reference(
    query: torch.Tensor,  # [B, H, T, D]
    k_cache: torch.Tensor,  # [B, Hkv, S, D]
    v_cache: torch.Tensor,  # [B, Hkv, S, D]
    bias: torch.Tensor,  # [B, 1, G*T, S] additive mask from `additive_mask`
    scale: float,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,  # [H] learned sink logits
) -> torch.Tensor:
    """Masked attention over the whole store, GQA by folding query groups (no KV repeat)."""
    B, H, T, D = query.shape
    Hkv = k_cache.shape[1]
    q = query.reshape(B, Hkv, (H // Hkv) * T, D)  # heads of one group are adjacent in HF's layout
    if softcap == 0.0 and sinks is None:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k_cache, v_cache, attn_mask=bias, scale=scale
        )
    else:
        out = _attention_with_variants(q, k_cache, v_cache, bias, scale, softcap, sinks, T)
    return out.reshape(B, H, T, D).contiguous()  # the fake kernel promises a contiguous result


def _attention_with_variants(q, k_cache, v_cache, bias, scale: float, softcap: float, sinks, T: int):
    """SDPA with a softcap and a sink column, in HF's eager order: scale, softcap, mask, softmax (float32;
    with sinks, over the slots and the sink in the logits' dtype, the sink then dropped)."""
    logits = torch.matmul(q, k_cache.transpose(-1, -2)) * scale  # [B, Hkv, G*T, S]
    if softcap != 0.0:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits + bias
    if sinks is None:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [B, Hkv, G*T, S]
    else:
        B, Hkv, GT, S = logits.shape
        sink = sinks.reshape(1, Hkv, GT // T, 1, 1).expand(B, Hkv, GT // T, T, 1).reshape(B, Hkv, GT, 1)
        logits = torch.cat([logits, sink.to(logits.dtype)], dim=-1)  # [B, Hkv, G*T, S+1]
        logits = logits - logits.amax(dim=-1, keepdim=True)  # as GPT-OSS's eager attention does
        probs = torch.softmax(logits, dim=-1, dtype=logits.dtype)[..., :S]  # [B, Hkv, G*T, S]
    return torch.matmul(probs.to(v_cache.dtype), v_cache)  # [B, Hkv, G*T, D]


def attention_mask_kernel(
    write_slots: torch.Tensor,
    query_pos: torch.Tensor,
    query_branch: torch.Tensor,
    query_limit: torch.Tensor,
    slot_pos: torch.Tensor,
    slot_branch: torch.Tensor,
    window: int,
    chunk: int,
    groups: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The generic additive mask ``[B, 1, G*T, S]`` of one layer kind, one node that the
    ``specialize_attention`` pass replaces with the stage's own construction."""
    mask = build_attention_mask(
        write_slots, query_pos, query_branch, query_limit, slot_pos, slot_branch, window, chunk
    )
    return additive_mask(mask, groups, dtype)


saguaro_attention_mask = torch.library.custom_op(
    f"{OP_NAMESPACE}::attention_mask", attention_mask_kernel, mutates_args=()
)


@saguaro_attention_mask.register_fake
def _saguaro_attention_mask_fake(
    write_slots, query_pos, query_branch, query_limit, slot_pos, slot_branch, window, chunk, groups, dtype
):
    B, T = write_slots.shape
    return slot_pos.new_empty((B, 1, groups * T, slot_pos.shape[1]), dtype=dtype)


def _write_kv(key, value, k_cache, v_cache, write_slots) -> None:
    B, Hkv, T, D = key.shape
    index = write_slots[:, None, :, None].expand(B, Hkv, T, D)
    k_cache.scatter_(2, index, key.to(k_cache.dtype))
    v_cache.scatter_(2, index, value.to(v_cache.dtype))


def attention_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    write_slots: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Write ``key``/``value`` ``[B, Hkv, T, D]`` at ``write_slots [B, T]`` and attend under the additive
    mask ``bias [B, 1, G*T, S]``; returns ``[B, H, T, D]``."""
    _write_kv(key, value, k_cache, v_cache, write_slots)
    return attention_reference(query, k_cache, v_cache, bias, scale)


saguaro_attention = torch.library.custom_op(
    f"{OP_NAMESPACE}::attention", attention_kernel, mutates_args=("k_cache", "v_cache")
)


@saguaro_attention.register_fake
def _saguaro_attention_fake(query, key, value, k_cache, v_cache, write_slots, bias, scale):
    return query.new_empty(query.shape)  # contiguous [B, H, T, D], like the real output


def attention_variants_kernel(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    write_slots: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """``saguaro::attention`` with a logit ``softcap`` (0: none) and/or ``sinks [H]``: a separate op, so the
    plain op keeps its short schema, as each argument costs dispatch time
    (docs/measurements/2026-12-07-figures-from-core-tensor-math-capture.md)."""
    _write_kv(key, value, k_cache, v_cache, write_slots)
    return attention_reference(query, k_cache, v_cache, bias, scale, softcap, sinks)


saguaro_attention_variants = torch.library.custom_op(
    f"{OP_NAMESPACE}::attention_variants", attention_variants_kernel, mutates_args=("k_cache", "v_cache")
)


@saguaro_attention_variants.register_fake
def _saguaro_attention_variants_fake(
    query, key, value, k_cache, v_cache, write_slots, bias, scale, softcap, sinks
):
    return query.new_empty(query.shape)  # contiguous [B, H, T, D], like the real output


ATTENTION_OP = torch.ops.saguaro.attention.default
VARIANTS_OP = torch.ops.saguaro.attention_variants.default
ATTENTION_OPS = (ATTENTION_OP, VARIANTS_OP)  # one of them per layer
MASK_OP = torch.ops.saguaro.attention_mask.default

# The ops' own Python kernels, for graphs that run eagerly (:func:`direct_kernel_calls`).
KERNELS = {
    ATTENTION_OP: attention_kernel,
    VARIANTS_OP: attention_variants_kernel,
    MASK_OP: attention_mask_kernel,
}


def direct_kernel_calls(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm``'s graph calling the saguaro ops' kernels themselves, for eager stages (the dispatcher's wrapper
    imports ``torch._dynamo``: docs/measurements/2026-12-07-figures-from-core-tensor-math-capture.md);
    ``gm`` keeps the ops, and a graph without them comes back as it is."""
    if not any(n.op == "call_function" and n.target in KERNELS for n in gm.graph.nodes):
        return gm
    graph = copy.deepcopy(gm.graph)
    for node in graph.nodes:
        if node.op == "call_function" and node.target in KERNELS:
            node.target = KERNELS[node.target]
    return torch.fx.GraphModule(gm, graph)
