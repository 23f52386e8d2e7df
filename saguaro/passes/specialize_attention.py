"""Pass ``specialize_attention``: each generic mask node replaced by the stage kind's own construction.

Each ``saguaro::attention_mask`` becomes inlined ``causal_bias`` or ``tree_bias`` of ``kind``
(:mod:`saguaro.capture.attention_op`), equal on the stage's inputs, its node marked ``meta["saguaro_mask"]``.
Requires ``generic_mask`` (invalidated); guarantees ``stage_mask``. ``PassError`` for a graph without mask
nodes or another arity; ``ValueError`` for an unknown ``kind``.
"""

from __future__ import annotations

import logging

import torch

from saguaro.capture.attention_op import MASK_OP, causal_bias, tree_bias
from saguaro.passes.base.graph_pass import GENERIC_MASK, STAGE_MASK, GraphPass
from saguaro.passes.base.graph_splice import PassError, inline_function

log = logging.getLogger(__name__)

KINDS = ("causal", "tree")


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not allowed: choose one of {', '.join(KINDS)}")


def specialize_attention(gm: torch.fx.GraphModule, kind: str) -> torch.fx.GraphModule:
    check_kind(kind)
    masks = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is MASK_OP]
    if not masks:
        raise PassError(
            "specialize_attention: no saguaro::attention_mask node in the graph (already specialised?)"
        )
    for node in masks:
        if len(node.args) != 10:
            raise PassError(
                f"specialize_attention: FX node {node.name!r} has {len(node.args)} arguments, expected 10"
            )
        (
            write_slots,
            query_pos,
            query_branch,
            query_limit,
            slot_pos,
            slot_branch,
            window,
            chunk,
            groups,
            dtype,
        ) = node.args
        constants = dict(window=window, chunk=chunk, groups=groups, dtype=dtype)
        if kind == "causal":
            new = inline_function(
                gm, causal_bias, [write_slots, query_pos, slot_pos, slot_branch], node, **constants
            )
        else:
            new = inline_function(
                gm,
                tree_bias,
                [write_slots, query_pos, query_branch, query_limit, slot_pos, slot_branch],
                node,
                **constants,
            )
        new.meta["saguaro_mask"] = {"window": int(window), "chunk": int(chunk)}
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    log.info("specialize_attention(%s): rewrote %d mask node(s)", kind, len(masks))
    return gm


class SpecializeAttention(GraphPass):
    """The pass for a stage whose mask kind is ``kind`` (``causal`` or ``tree``)."""

    name = "specialize_attention"
    requires = frozenset({GENERIC_MASK})
    guarantees = frozenset({STAGE_MASK})
    invalidates = frozenset({GENERIC_MASK})

    def __init__(self, kind: str):
        check_kind(kind)
        self.kind = kind

    def run(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        return specialize_attention(gm, self.kind)
