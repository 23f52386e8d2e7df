"""Pass ``linear_as_reduction``: each linear as a product and a sum that reads its weight once for all rows.

Every ``aten.linear(x [..., K], W [N, K], b)`` of known input ranks becomes ``W[N, 1, K] * x[1, M, K]``
summed over K, forced rows-major ``[M, N]``, reshaped to ``[..., N]`` (+ b), which Inductor fuses into one
reduction; others are left, with a warning. Equal up to rounding. For few-row stages:
docs/measurements/2026-12-02-linear-as-reduction.md. Requires nothing; guarantees ``linears_as_reductions``.
"""

from __future__ import annotations

import logging

import torch

from saguaro.passes.base.graph_pass import LINEARS_AS_REDUCTIONS, GraphPass
from saguaro.passes.base.graph_splice import get_attribute, replace_node

log = logging.getLogger(__name__)

aten = torch.ops.aten
LINEAR = aten.linear.default


def _shape(gm: torch.fx.GraphModule, node) -> tuple | None:
    """The shape of ``node``'s value (a held tensor's, else its ``val`` metadata's); None when unknown."""
    if not isinstance(node, torch.fx.Node):
        return None
    value = get_attribute(gm, node.target) if node.op == "get_attr" else node.meta.get("val")
    shape = getattr(value, "shape", None)
    return tuple(shape) if isinstance(shape, (tuple, torch.Size)) else None


def _rewrite(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Replace one linear node; False (left alone) unless its ranks are known and ``[..., K] x [N, K]``."""
    graph = gm.graph
    x, weight = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    x_shape, weight_shape = _shape(gm, x), _shape(gm, weight)
    if not x_shape or weight_shape is None or len(weight_shape) != 2:
        return False
    rank, (n, k) = len(x_shape), weight_shape
    call = graph.call_function
    with graph.inserting_before(node):
        leading = [call(aten.sym_size.int, (x, d)) for d in range(rank - 1)]  # the sizes of x's "..."
        rows = call(aten.unsqueeze.default, (call(aten.reshape.default, (x, [-1, k])), 0))  # [1, M, K]
        product = call(aten.mul.Tensor, (call(aten.unsqueeze.default, (weight, 1)), rows))  # [N, M, K]
        summed = call(aten.permute.default, (call(aten.sum.dim_IntList, (product, [-1])), [1, 0]))  # [M, N]
        # rows-major, as linear's output: else Inductor lays the consumers out [N, M] too and the next
        # reduction vectorises over M instead of K (far slower)
        summed = call(force_stride_order(), (summed, [n, 1]))
        out = call(aten.reshape.default, (summed, [*leading, n]))  # [..., N]
        if bias is not None:
            out = call(aten.add.Tensor, (out, bias))
    replace_node(graph, node, out)
    return True


def force_stride_order():
    """Inductor's op that lays a tensor out with the given strides (a copy in eager when it differs)."""
    import torch._inductor.inductor_prims

    return torch.ops.prims.inductor_force_stride_order.default


def linear_as_reduction(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    linears = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is LINEAR]
    rewritten = sum(_rewrite(gm, n) for n in linears)
    if rewritten != len(linears):
        log.warning(
            "linear_as_reduction: %d of %d linears left as they were (their ranks are not known)",
            len(linears) - rewritten,
            len(linears),
        )
    gm.graph.lint()
    gm.recompile()
    log.info("linear_as_reduction: %d linears as a product and a sum", rewritten)
    return gm


class LinearAsReduction(GraphPass):
    name = "linear_as_reduction"
    requires = frozenset()
    requires_nothing_because = "each linear node is replaced by its own definition, whatever surrounds it"
    guarantees = frozenset({LINEARS_AS_REDUCTIONS})

    def run(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        return linear_as_reduction(gm)
