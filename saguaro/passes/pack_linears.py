"""Pass: each linear layer of a few-row stage as the packed few-row kernel over its weight's panels.

A verify, glue or tree stage multiplies ``K+1`` or ``MQ`` rows by every weight of the model: its time is the
weights' bytes. ``linear_as_reduction`` reads each weight once for all rows, but reloads and widens each weight
row once per activation row; a BLAS GEMM register-blocks the rows but reads float32 weights only. This pass
rewrites every ``aten.linear(x [..., K], W [N, K], b)`` whose weight is a module attribute as

    x -> [M, K]  ->  saguaro_kernels.packed_linear(x, panels [P, K, 16], N)  ->  [M, N]  ->  [..., N]  (+ b)

over the weight packed once into panels of 16 output columns (:func:`~saguaro.tensor_math.packed_linear.pack`)
held by the stage module; with ``narrow`` the panels hold the weight in float16 (else bfloat16) where every
value is exactly one (:func:`~saguaro.passes.narrow_weights.narrow_copy`), widened in registers. The kernel
register-blocks 6 rows x 16 columns and sums each output over K in order with fused multiply-adds in float32,
so a stage's outputs do not depend on ``narrow`` (bit for bit); they differ from MKL's by rounding (another
summation order), as ``linear_as_reduction``'s do. Inductor calls the op as an extern kernel from its C++
wrapper. The panels are made once per weight tensor and version and shared by every stage that reads them.

Requires: nothing (each linear is replaced by its own definition). Guarantees: ``linears_packed``: every
``aten.linear`` over a 2-D float32 weight attribute with known input ranks is rewritten (others are left as
they were, with a warning).
"""

from __future__ import annotations

import logging

import torch
from torch.utils.weak import WeakIdKeyDictionary

from saguaro.passes.base.graph_pass import LINEARS_PACKED, GraphPass
from saguaro.passes.base.graph_splice import PassError, drop_unread_attributes, get_attribute
from saguaro.passes.narrow_weights import SAGUARO_PREFIX, narrow_copy, version
from saguaro.tensor_math.packed_linear import available, pack, unavailable_reason

log = logging.getLogger(__name__)

aten = torch.ops.aten
LINEAR = aten.linear.default
ATTRIBUTE_PREFIX = SAGUARO_PREFIX + "panels_"  # the stage module's buffer holding a weight's panels
_PACKED = WeakIdKeyDictionary()  # float32 weight -> {(its version, narrow): its panels}


def panels(weight: torch.Tensor, narrow: bool) -> torch.Tensor:
    """``weight [N, K]``'s panels ``[P, K, 16]``: float16 / bfloat16 where ``narrow`` and exact, else float32;
    made once per tensor, version and ``narrow``."""
    known = _PACKED.setdefault(weight, {})
    key = (version(weight), narrow)
    if key not in known:
        known.clear()  # an older version's panels are stale
        source = narrow_copy(weight) if narrow else None
        known[key] = pack(weight.detach() if source is None else source)
    return known[key]


def _value_shape(node) -> tuple | None:
    shape = getattr(node.meta.get("val"), "shape", None) if isinstance(node, torch.fx.Node) else None
    return tuple(shape) if isinstance(shape, (tuple, torch.Size)) else None


def pack_linears(gm: torch.fx.GraphModule, narrow: bool = True) -> torch.fx.GraphModule:
    """Rewrite every linear of ``gm`` over a 2-D float32 weight attribute as the packed kernel; returns ``gm``."""
    if not available():
        raise PassError(f"pack_linears: the packed kernel could not be built ({unavailable_reason()})")
    graph = gm.graph
    linears = [n for n in graph.nodes if n.op == "call_function" and n.target is LINEAR]
    names: dict = {}  # weight attribute -> its panels' buffer (a weight read by several linears)
    rewritten, panel_bytes = 0, 0
    for node in linears:
        x, weight_node = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        weight = get_attribute(gm, weight_node.target) if weight_node.op == "get_attr" else None
        x_shape = _value_shape(x)
        if (not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype != torch.float32
                or not x_shape or x_shape[-1] != weight.shape[1]):
            continue
        n, k = weight.shape
        name = names.get(weight_node.target)
        if name is None:
            name = names[weight_node.target] = ATTRIBUTE_PREFIX + weight_node.target.replace(".", "_")
            if hasattr(gm, name):
                raise PassError(f"pack_linears: the module already has an attribute {name!r}")
            held = panels(weight, narrow)
            gm.register_buffer(name, held, persistent=False)
            panel_bytes += held.numel() * held.element_size()
        call = graph.call_function
        with graph.inserting_before(node):
            leading = [call(aten.sym_size.int, (x, d)) for d in range(len(x_shape) - 1)]  # the sizes of x's "..."
            rows = call(aten.reshape.default, (x, [-1, k]))  # [M, K]
            out = call(torch.ops.saguaro_kernels.packed_linear.default, (rows, graph.get_attr(name), n))  # [M, N]
            out = call(aten.reshape.default, (out, [*leading, n]))  # [..., N]
            if bias is not None:
                out = call(aten.add.Tensor, (out, bias))
        out.meta.update({key: v for key, v in node.meta.items() if key in ("val", "tensor_meta", "stack_trace")})
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        rewritten += 1
    for node in list(graph.nodes):  # the float32 weights' reads no linear takes now
        if node.op == "get_attr" and not node.users and not node.target.startswith(ATTRIBUTE_PREFIX):
            graph.erase_node(node)
    dropped = drop_unread_attributes(gm, names)  # the stage module holds the panels only
    if rewritten != len(linears):
        log.warning("pack_linears: %d of %d linears left as they were (not a 2-D float32 weight attribute of "
                    "known input rank)", len(linears) - rewritten, len(linears))
    graph.lint()
    gm.recompile()
    log.info("pack_linears: %d linears packed, %.1f MiB of panels, %.1f MiB of weights no longer held", rewritten,
             panel_bytes / 2**20, dropped / 2**20)
    return gm


class PackLinears(GraphPass):
    name = "pack_linears"
    requires = frozenset()
    requires_nothing_because = "each linear node is replaced by its own definition, whatever surrounds it"
    guarantees = frozenset({LINEARS_PACKED})

    def __init__(self, narrow: bool = True):
        self.narrow = narrow

    def run(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        return pack_linears(gm, self.narrow)
