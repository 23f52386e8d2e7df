"""Pass ``lower_attention``: each ``saguaro::attention`` node in the form the backend runs.

By ``implementation`` (:data:`IMPLEMENTATIONS`, picked by :mod:`saguaro.lower.kernel_choice`): ``"op"`` keeps
the op; ``"inline"`` is its math in the graph (the KV write an ``index_put_``, then ``attention_reference``),
equal to the op; ``"reduce"`` and ``"kernel"`` are ``"inline"`` with another attention
(:func:`attention_reduced`, :func:`attention_kernel`); ``"flex"`` writes the KV, then FlexAttention under a
block mask built in the graph per layer kind (``meta["saguaro_mask"]``, else ``window``), the additive masks
removed. The last three equal the op up to rounding. Requires ``flat_signature``, ``stage_mask`` and
``epilogue_spliced``; guarantees ``attention_lowered``. ``PassError`` for a graph without attention nodes, a
node of another arity, or (flex) a missing :data:`MASK_INPUTS`; ``ValueError`` for an unknown form.
"""

from __future__ import annotations

import logging

import torch

from saguaro.capture.attention_op import ATTENTION_OP, ATTENTION_OPS, attention_reference, kind_allows
from saguaro.passes.base.graph_pass import (
    ATTENTION_LOWERED,
    EPILOGUE_SPLICED,
    FLAT_SIGNATURE,
    STAGE_MASK,
    GraphPass,
)
from saguaro.passes.base.graph_splice import PassError, keeps_mutations

log = logging.getLogger(__name__)

IMPLEMENTATIONS = ("op", "inline", "flex", "reduce", "kernel")
# query, key, value, k_cache, v_cache, write_slots, bias, scale (+ softcap, sinks for the variants op)
OP_ARGS = {op: 8 if op is ATTENTION_OP else 10 for op in ATTENTION_OPS}
MASK_INPUTS = ("write_slots", "positions", "query_branch", "query_limit", "slot_pos", "slot_branch")


def write_kv(
    key: torch.Tensor,  # [B, Hkv, T, D]
    value: torch.Tensor,  # [B, Hkv, T, D]
    k_cache: torch.Tensor,  # [B, Hkv, S, D], written in place
    v_cache: torch.Tensor,  # [B, Hkv, S, D], written in place
    write_slots: torch.Tensor,  # [B, T]
) -> None:
    """The op's KV write as an ``index_put_`` (a compiler re-inplaces it into the store)."""
    B, Hkv = key.shape[0], key.shape[1]
    rows = torch.arange(B, device=key.device)[:, None, None]  # [B, 1, 1]
    heads = torch.arange(Hkv, device=key.device)[None, :, None]  # [1, Hkv, 1]
    index = (rows, heads, write_slots[:, None, :])  # broadcast to [B, Hkv, T]
    k_cache.index_put_(index, key.to(k_cache.dtype))
    v_cache.index_put_(index, value.to(v_cache.dtype))


def attention_inline(
    query: torch.Tensor,  # [B, H, T, D]
    key: torch.Tensor,  # [B, Hkv, T, D]
    value: torch.Tensor,  # [B, Hkv, T, D]
    k_cache: torch.Tensor,  # [B, Hkv, S, D], written in place
    v_cache: torch.Tensor,  # [B, Hkv, S, D], written in place
    write_slots: torch.Tensor,  # [B, T]
    bias: torch.Tensor,  # [B, 1, G*T, S]
    scale: float,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,  # [H]
) -> torch.Tensor:
    """The ``saguaro::attention`` op as traceable tensor code; returns ``[B, H, T, D]``."""
    write_kv(key, value, k_cache, v_cache, write_slots)
    return attention_reference(query, k_cache, v_cache, bias, scale, softcap, sinks)


def attention_reduced(
    query, key, value, k_cache, v_cache, write_slots, bias, scale: float, softcap: float = 0.0, sinks=None
) -> torch.Tensor:  # the arguments (and their shapes) of attention_inline
    """``"inline"`` with the attention as products and sums Inductor reduces itself, not SDPA (whose CPU
    kernel spends a one-query call in BLAS set-up); softcap, sinks: as ``"inline"``. ``[B, H, T, D]``."""
    from saguaro.passes.linear_as_reduction import force_stride_order

    if softcap != 0.0 or sinks is not None:
        return attention_inline(query, key, value, k_cache, v_cache, write_slots, bias, scale, softcap, sinks)
    write_kv(key, value, k_cache, v_cache, write_slots)
    B, H, T, D = query.shape
    Hkv = k_cache.shape[1]
    rows = (H // Hkv) * T  # a KV head's query rows: its group's heads, each T tokens
    q = force_stride_order()(query.reshape(B, Hkv, rows, D), [Hkv * rows * D, rows * D, D, 1])
    logits = (q[:, :, :, None, :] * k_cache[:, :, None, :, :]).sum(-1) * scale + bias  # [B, Hkv, rows, S]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(v_cache.dtype)  # [B, Hkv, rows, S]
    out = (probs[..., None] * v_cache[:, :, None, :, :]).sum(-2)  # [B, Hkv, rows, D]
    return out.reshape(B, H, T, D).to(query.dtype).contiguous()


def attention_kernel(
    query, key, value, k_cache, v_cache, write_slots, bias, scale: float, softcap: float = 0.0, sinks=None
) -> torch.Tensor:  # the arguments (and their shapes) of attention_inline
    """``"inline"`` with the attention as ``saguaro_kernels::masked_attention`` (query groups folded into
    rows); softcap, sinks or not float32: :func:`attention_inline`. ``[B, H, T, D]``."""
    float32 = all(t.dtype == torch.float32 for t in (query, k_cache, v_cache, bias))
    if softcap != 0.0 or sinks is not None or not float32:
        return attention_inline(query, key, value, k_cache, v_cache, write_slots, bias, scale, softcap, sinks)
    write_kv(key, value, k_cache, v_cache, write_slots)
    B, H, T, D = query.shape
    Hkv = k_cache.shape[1]
    q = query.reshape(B, Hkv, (H // Hkv) * T, D)  # [B, Hkv, G*T, D]: heads of one group are adjacent
    out = torch.ops.saguaro_kernels.masked_attention(q, k_cache, v_cache, bias, scale)  # [B, Hkv, G*T, D]
    return out.reshape(B, H, T, D)


def flex_block_mask(
    write_slots: torch.Tensor,  # [B, T]
    query_pos: torch.Tensor,  # [B, T]
    query_branch: torch.Tensor,  # [B, T]
    query_limit: torch.Tensor,  # [B, T]
    slot_pos: torch.Tensor,  # [B, S]
    slot_branch: torch.Tensor,  # [B, S]
    window: int,
    chunk: int = 0,
):
    """The FlexAttention ``BlockMask`` of ``build_attention_mask``'s rule for one layer kind, every head."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = write_slots.shape
    S = slot_pos.shape[1]

    def visible(b, h, q, kv):
        # kernels may evaluate the rule on the padding of the last query / key block: stay in bounds
        q, kv = q.clamp(max=T - 1), kv.clamp(max=S - 1)
        s_pos, s_branch, q_pos = slot_pos[b, kv], slot_branch[b, kv], query_pos[b, q]
        shared = (s_branch == 0) & (s_pos <= query_limit[b, q])
        own = (s_branch == query_branch[b, q]) & (s_pos <= q_pos)
        allowed = kind_allows((s_pos >= 0) & (shared | own), s_pos, q_pos, window, chunk)
        return allowed | (kv == write_slots[b, q])  # a query always sees its own slot

    return create_block_mask(visible, B, None, T, S, device=slot_pos.device)


def attention_flex(
    query: torch.Tensor,  # [B, H, T, D]
    key: torch.Tensor,  # [B, Hkv, T, D]
    value: torch.Tensor,  # [B, Hkv, T, D]
    k_cache: torch.Tensor,  # [B, Hkv, S, D], written in place
    v_cache: torch.Tensor,  # [B, Hkv, S, D], written in place
    write_slots: torch.Tensor,  # [B, T]
    block_mask,  # from flex_block_mask
    scale: float,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,  # [H]
) -> torch.Tensor:
    """The op with FlexAttention over the store; returns ``[B, H, T, D]``."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    write_kv(key, value, k_cache, v_cache, write_slots)
    score_mod = None
    if softcap != 0.0:

        def score_mod(score, b, h, q, kv):  # scores arrive scaled, before the mask: HF's order
            return torch.tanh(score / softcap) * softcap

    gqa = query.shape[1] != k_cache.shape[1]
    if sinks is None:
        out = flex_attention(
            query, k_cache, v_cache, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa
        )
        return out.contiguous()
    out, aux = flex_attention(
        query,
        k_cache,
        v_cache,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=gqa,
        return_aux=AuxRequest(lse=True),
    )  # lse: [B, H, T]
    keep = torch.sigmoid(aux.lse - sinks.to(aux.lse.dtype)[None, :, None])  # [B, H, T]: 1 - the sink's share
    return (out * keep[..., None].to(out.dtype)).contiguous()


def check_implementation(implementation: str) -> None:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation={implementation!r} is not allowed: choose one of {', '.join(IMPLEMENTATIONS)}"
        )


def lower_attention(gm: torch.fx.GraphModule, implementation: str, window: int = 0) -> torch.fx.GraphModule:
    check_implementation(implementation)
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ATTENTION_OPS]
    if not nodes:
        raise PassError("lower_attention: no saguaro::attention node in the graph (already lowered?)")
    if implementation == "op":
        log.info("lower_attention(op): kept %d attention node(s)", len(nodes))
        return gm
    for node in nodes:
        if len(node.args) != OP_ARGS[node.target] or node.kwargs:
            raise PassError(
                f"lower_attention: FX node {node.name!r} has {len(node.args)} positional and "
                f"{len(node.kwargs)} keyword arguments, expected {OP_ARGS[node.target]} and 0"
            )
    if implementation in ("inline", "reduce", "kernel"):
        target = {"inline": attention_inline, "reduce": attention_reduced, "kernel": attention_kernel}[
            implementation
        ]
        for node in nodes:  # same arguments, same result (reduce, kernel: up to rounding), same cache writes
            node.target = target
    else:
        inputs = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
        missing = [name for name in MASK_INPUTS if name not in inputs]
        if missing:
            raise PassError(
                f"lower_attention(flex): the graph has no input(s) {missing} to build the block mask "
                "from (run flatten_signature first)"
            )
        block_masks = {}  # (window, chunk) -> its block mask node: one per layer kind per forward
        for node in nodes:
            kind = node.args[6].meta.get("saguaro_mask", {"window": window, "chunk": 0})
            key = (kind["window"], kind["chunk"])
            if key not in block_masks:
                with gm.graph.inserting_before(nodes[0]):
                    block_masks[key] = gm.graph.call_function(
                        flex_block_mask, (*(inputs[n] for n in MASK_INPUTS), *key)
                    )
            node.target = attention_flex
            node.args = (*node.args[:6], block_masks[key], *node.args[7:])
        gm.graph.eliminate_dead_code(is_impure_node=keeps_mutations)  # the additive masks are unused now
    gm.graph.lint()
    gm.recompile()
    log.info("lower_attention(%s): rewrote %d attention node(s)", implementation, len(nodes))
    return gm


class LowerAttention(GraphPass):
    """The pass to ``implementation``; ``window``: the model's sliding window, for masks without metadata."""

    name = "lower_attention"
    requires = frozenset({FLAT_SIGNATURE, STAGE_MASK, EPILOGUE_SPLICED})
    guarantees = frozenset({ATTENTION_LOWERED})

    def __init__(self, implementation: str, window: int = 0):
        check_implementation(implementation)
        self.implementation, self.window = implementation, window

    def run(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        return lower_attention(gm, self.implementation, window=self.window)
