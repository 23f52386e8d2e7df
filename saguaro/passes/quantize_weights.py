"""Pass ``quantize_weights``: each linear's weight quantized, weight-only, to int8 or int4.

Every ``aten.linear`` over a 2-D floating weight attribute (the LM head too) becomes
``saguaro::quantized_linear(x, packed, scales, N, b)`` over the weight quantized and packed; float weights no
longer read are dropped. Run once on the base graph: every stage reads the same weights. Requires nothing;
guarantees ``weights_quantized``. ``PassError`` on a graph quantized already or with no linear to quantize;
``ValueError`` for an unknown ``kind`` or a group size that does not divide a width.
"""

from __future__ import annotations

import logging

import torch

from saguaro.passes.base.graph_pass import WEIGHTS_QUANTIZED, GraphPass
from saguaro.passes.base.graph_splice import PassError, drop_unread_attributes, get_attribute, replace_node
from saguaro.passes.narrow_weights import SAGUARO_PREFIX
from saguaro.tensor_math.huge_pages import on_huge_pages
from saguaro.tensor_math.quantized_linear import (
    DEFAULT_INT4_GROUP,
    QUANTIZED_BITS,
    QUANTIZED_LINEAR,
    pack_quantized,
    quantize,
)

log = logging.getLogger(__name__)

LINEAR = torch.ops.aten.linear.default
ATTRIBUTE_PREFIX = SAGUARO_PREFIX + "quantized_"


def group_for(kind: str, width: int, group: int | None) -> int | None:
    """The group size of a ``kind`` weight of ``width`` columns: ``group`` if given; else per output column
    for int8, :data:`DEFAULT_INT4_GROUP` for int4 where it divides ``width`` (else the whole row)."""
    if group is not None or kind == "int8":
        return group
    return DEFAULT_INT4_GROUP if width % DEFAULT_INT4_GROUP == 0 else None


def quantize_weights(gm: torch.fx.GraphModule, kind: str, group: int | None = None) -> torch.fx.GraphModule:
    """Quantize every linear weight of ``gm`` to ``kind``, ``group`` ``k`` a scale; returns ``gm``."""
    if kind not in QUANTIZED_BITS:
        raise ValueError(f"quantize_weights: weights={kind!r}; allowed: {', '.join(QUANTIZED_BITS)}")
    graph = gm.graph
    if any(n.op == "call_function" and n.target is QUANTIZED_LINEAR for n in graph.nodes):
        raise PassError(
            "quantize_weights: the graph is already quantized (it holds saguaro::quantized_linear "
            "nodes); quantize a model once"
        )
    done: dict = {}  # weight attribute -> (packed name, scales name)
    count, held = 0, 0
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target is LINEAR]:
        weight_node = node.args[1]
        weight = get_attribute(gm, weight_node.target) if weight_node.op == "get_attr" else None
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.dtype.is_floating_point:
            continue
        n, k = weight.shape
        if weight_node.target not in done:
            bits = QUANTIZED_BITS[kind]
            try:
                q, scales = quantize(weight, bits, group_for(kind, k, group))
            except ValueError as exc:
                raise ValueError(
                    f"weights={kind!r}, weight_group_size={group!r} cannot quantize "
                    f"{weight_node.target} [{n}, {k}]: {exc}"
                ) from None
            packed, packed_scales = (on_huge_pages(t) for t in pack_quantized(q, scales, bits))
            base = ATTRIBUTE_PREFIX + weight_node.target.replace(".", "_")
            for name, tensor in ((base, packed), (base + "_scales", packed_scales)):
                if hasattr(gm, name):
                    raise PassError(f"quantize_weights: the module already has an attribute {name!r}")
                gm.register_buffer(name, tensor, persistent=False)
                held += tensor.numel() * tensor.element_size()
            done[weight_node.target] = (base, base + "_scales")
        packed_name, scales_name = done[weight_node.target]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        with graph.inserting_before(node):
            packed_node, scales_node = graph.get_attr(packed_name), graph.get_attr(scales_name)
            out = graph.call_function(QUANTIZED_LINEAR, (node.args[0], packed_node, scales_node, n, bias))
        replace_node(graph, node, out)
        count += 1
    if count == 0:
        raise PassError(
            f"quantize_weights: weights={kind!r} found no linear layer over a floating weight "
            "attribute to quantize"
        )
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
    read = {n.target for n in graph.nodes if n.op == "get_attr"}
    dropped = drop_unread_attributes(gm, [name for name in done if name not in read])
    graph.lint()
    gm.recompile()
    log.info(
        "quantize_weights: %d linears to %s, %.1f MiB held, %.1f MiB of float weights dropped",
        count,
        kind,
        held / 2**20,
        dropped / 2**20,
    )
    return gm


class QuantizeWeights(GraphPass):
    name = "quantize_weights"
    requires = frozenset()
    requires_nothing_because = (
        "each linear node is replaced by its own quantized definition, whatever surrounds it"
    )
    guarantees = frozenset({WEIGHTS_QUANTIZED})

    def __init__(self, kind: str, group: int | None = None):
        self.kind, self.group = kind, group

    def run(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        return quantize_weights(gm, self.kind, self.group)
