"""Pass: each linear layer of a few-row stage as a product and a sum that reads its weight once.

A decode step multiplies one row of activations (SD's verify and the glue ``K+1``, a tree ``MQ``) by
every weight matrix of the model: it is bound by how fast the weights stream from memory. On a CPU the
BLAS call behind ``aten.linear`` (MKL's GEMV and small-M GEMM) reads them at about half the memory's rate
here, and a small-M GEMM re-reads them per block of rows. This pass rewrites every
``aten.linear(x [..., K], W [N, K], b [N])`` as

    W[N, 1, K] * x[1, M, K]  ->  sum over K  ->  [N, M]  ->  [M, N], laid out rows-major  ->  [..., N]  (+ b)

(``M``: the rows of ``x [..., K]``), which Inductor fuses into one vectorised C++ reduction whose outer
loop runs over the weight's rows ``N`` and whose inner loop over the activation rows reuses each weight
row from the L1 cache: every weight is read once per call, whatever the number of rows. The result is
forced rows-major (``prims.inductor_force_stride_order``): left to itself Inductor lays the next
pointwise ops out ``[N, M]`` like the sum, and the next reduction then vectorises over ``M``, ten
times slower. Measured on this CPU (one thread, the default pair's target's 43 weights): one pass over
them at M=1 about 2x faster than MKL, at M=6 about 2.2x; at M=32 even; at prefill lengths far slower
(no register blocking), so :func:`~saguaro.lower.lowering.linear_implementation` applies it to the
stages of few rows only.

Requires: nothing (each node is replaced by its own definition). Guarantees: ``linears_as_reductions``:
every ``aten.linear`` whose input ranks the graph's metadata records is rewritten (any other is left as
it was, with a warning); outputs equal the linear's up to float rounding (another summation
order over ``K``: greedy tokens can differ from MKL's only where two logits tie within rounding).
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
    """The shape of ``node``'s value: a parameter's own, else from the ``val`` metadata (a fake tensor, or a
    :class:`~saguaro.capture.graph_file.TensorSpec` in a graph read from disk); None when unknown."""
    if not isinstance(node, torch.fx.Node):
        return None
    value = get_attribute(gm, node.target) if node.op == "get_attr" else node.meta.get("val")
    shape = getattr(value, "shape", None)
    return tuple(shape) if isinstance(shape, (tuple, torch.Size)) else None


def _rewrite(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Replace one linear node; False (left alone) when the ranks are not known or not [..., K] x [N, K]."""
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
        # rows-major in memory, as linear's output: else Inductor lays the consumers out [N, M] too, and
        # the next linear's reduction then vectorises over the rows M instead of over K (ten times slower)
        summed = call(force_stride_order(), (summed, [n, 1]))
        out = call(aten.reshape.default, (summed, [*leading, n]))  # [..., N]
        if bias is not None:
            out = call(aten.add.Tensor, (out, bias))
    replace_node(graph, node, out)
    return True


def force_stride_order():
    """Inductor's op that lays a tensor out with the given strides (a copy in eager when it differs)."""
    import torch._inductor.inductor_prims  # noqa: F401 - registers the prims.inductor_* ops

    return torch.ops.prims.inductor_force_stride_order.default


def linear_as_reduction(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    linears = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is LINEAR]
    rewritten = sum(_rewrite(gm, n) for n in linears)
    if rewritten != len(linears):
        log.warning("linear_as_reduction: %d of %d linears left as they were (their ranks are not known)",
                    len(linears) - rewritten, len(linears))
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
