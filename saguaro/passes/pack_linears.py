"""Pass: each linear layer of a few-row stage as the packed few-row kernel over its weight's panels.

A verify, glue or tree stage multiplies ``K+1`` or ``MQ`` rows by every weight of the model: its time is the
weights' bytes. ``linear_as_reduction`` reads each weight once for all rows, but reloads and widens each weight
row once per activation row; a BLAS GEMM register-blocks the rows but reads float32 weights only. This pass
rewrites every ``aten.linear(x [..., K], W [N, K], b)`` whose weight is a module attribute as

    x -> [M, K]  ->  saguaro_kernels.packed_linear(x, panels [P, K, 64], N)  ->  [M, N]  ->  [..., N]  (+ b)

over the weight packed once into panels of 64 output columns (:func:`~saguaro.tensor_math.packed_linear.pack`)
held by the stage module; a float32 weight with ``narrow`` is held in float16 (else bfloat16) where every
value is exactly one (:func:`~saguaro.passes.narrow_weights.narrow_copy`); a float16 or bfloat16 weight (a model
loaded in that dtype) is packed as it is, its 16-bit input widened exactly to float32 for the kernel and the
float32 sums rounded once back, as a 16-bit GEMM accumulating in float32 rounds them. The kernel widens in
registers and sums each output over K in order with fused multiply-adds in float32, so a stage's outputs do not
depend on ``narrow`` nor on the number of rows (bit for bit); they differ from MKL's by rounding (another
summation order), as ``linear_as_reduction``'s do. ``saguaro::quantized_linear`` nodes (``quantize_weights``)
become ``packed_linear_q`` over their panels as they are held. Inductor calls the op as an extern kernel from its C++
wrapper. The panels are made once per weight tensor and version and shared by every stage that reads them.

Linears that read one input (an attention layer's q / k / v projections, an MLP's gate / up: the groups
``fuse_projections`` joins) become one call over the panels of their weights concatenated along N, its output
sliced back per part (the biases, when all present, added joined): a draft step makes 17 kernel calls rather
than 29. Exact: output column ``o_i + n`` of the joined call is the same sum over K of the same ``x`` row and
weight row as column ``n`` of part ``i`` (the kernel computes each column on its own). Only the joined panels
are kept, not a joined float32 copy.

Requires: nothing (each linear is replaced by its own definition). Guarantees: ``linears_packed``: every
``aten.linear`` over a 2-D float32, float16 or bfloat16 weight attribute of its input's dtype with known input
ranks, and every ``saguaro::quantized_linear``, is rewritten (others are left as
they were, with a warning).
"""

from __future__ import annotations

import logging

import torch
from torch.utils.weak import WeakIdKeyDictionary

from saguaro.passes.base.graph_pass import LINEARS_PACKED, GraphPass
from saguaro.passes.base.graph_splice import PassError, drop_unread_attributes, get_attribute, replace_node
from saguaro.passes.fuse_projections import groups, slice_back
from saguaro.passes.narrow_weights import SAGUARO_PREFIX, exact_narrow, version
from saguaro.tensor_math.huge_pages import on_huge_pages
from saguaro.tensor_math.packed_linear import available, pack, unavailable_reason
from saguaro.tensor_math.quantized_linear import QUANTIZED_LINEAR

log = logging.getLogger(__name__)

aten = torch.ops.aten
prims = torch.ops.prims
LINEAR = aten.linear.default
ATTRIBUTE_PREFIX = SAGUARO_PREFIX + "panels_"  # the stage module's buffer holding a weight's panels
_PACKED = WeakIdKeyDictionary()  # float32 weight (a group's first) -> {(the versions of its group, narrow): panels}


def panels(weight: torch.Tensor, narrow: bool, *others: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]``'s panels ``[P, K, 64]`` (with ``others``: those of ``weight`` and ``others``
    concatenated along N): float16 / bfloat16 where ``narrow`` and every value is exactly one, else float32;
    made once per group of tensors, their versions and ``narrow``, on huge pages where the platform allows
    (:func:`~saguaro.tensor_math.huge_pages.on_huge_pages`). No narrow or joined copy is kept."""
    parts = (weight, *others)
    known = _PACKED.setdefault(weight, {})
    key = (tuple(id(t) for t in others), tuple(version(t) for t in parts), narrow)
    if key not in known:
        known.pop(next((k for k in known if k[0] == key[0]), None), None)  # an older version's panels are stale
        with torch.no_grad():
            whole = torch.cat([t.detach() for t in parts]) if others else weight.detach()  # [N, K]
            source = exact_narrow(whole) if narrow and whole.dtype == torch.float32 else None
            known[key] = on_huge_pages(pack(whole if source is None else source))
    return known[key]


def _value_shape(node) -> tuple | None:
    shape = getattr(node.meta.get("val"), "shape", None) if isinstance(node, torch.fx.Node) else None
    return tuple(shape) if isinstance(shape, (tuple, torch.Size)) else None


PACKED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the weights the kernel reads as they are


def _packable_weight(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.Tensor | None:
    """The weight of linear ``node`` when it is a 2-D float32, float16 or bfloat16 attribute of ``gm`` whose
    dtype its input's matches and whose width its input's last size fits."""
    weight_node, x_shape = node.args[1], _value_shape(node.args[0])
    weight = get_attribute(gm, weight_node.target) if weight_node.op == "get_attr" else None
    x_dtype = getattr(node.args[0].meta.get("val"), "dtype", None) if isinstance(node.args[0], torch.fx.Node) else None
    if (not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.dtype not in PACKED_DTYPES
            or x_dtype not in (None, weight.dtype) or not x_shape or x_shape[-1] != weight.shape[1]):
        return None
    return weight


def _bias(node: torch.fx.Node):
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")


def _packed_call(graph: torch.fx.Graph, x: torch.fx.Node, panels_name: str, n: int, k: int,
                 dtype: torch.dtype = torch.float32, scales_name: str | None = None) -> torch.fx.Node:
    """Nodes computing ``x [..., K]`` times the weight the panels ``panels_name`` hold: ``[..., N]``. A 16-bit
    ``x`` (``dtype``: the model's) is widened exactly to float32 for the kernel and its float32 sums rounded once
    to ``dtype``, as a 16-bit GEMM accumulating in float32 rounds them. With ``scales_name`` the panels are
    quantized ones (``quantize_weights``'), read by ``packed_linear_q``."""
    call = graph.call_function
    leading = [call(aten.sym_size.int, (x, d)) for d in range(len(_value_shape(x)) - 1)]  # the sizes of x's "..."
    rows = call(aten.reshape.default, (x, [-1, k]))  # [M, K]
    if dtype != torch.float32:
        rows = call(prims.convert_element_type.default, (rows, torch.float32))
    if scales_name is None:
        out = call(torch.ops.saguaro_kernels.packed_linear.default, (rows, graph.get_attr(panels_name), n))  # [M, N]
    else:
        out = call(torch.ops.saguaro_kernels.packed_linear_q.default,
                   (rows, graph.get_attr(panels_name), graph.get_attr(scales_name), n))  # [M, N]
    if dtype != torch.float32:
        out = call(prims.convert_element_type.default, (out, dtype))
    return call(aten.reshape.default, (out, [*leading, n]))  # [..., N]


def pack_linears(gm: torch.fx.GraphModule, narrow: bool = True, join: bool = True) -> torch.fx.GraphModule:
    """Rewrite every linear of ``gm`` over a 2-D float32 weight attribute as the packed kernel, with ``join`` the
    linears that read one input as one call (see the module docstring); returns ``gm``."""
    if not available():
        raise PassError(f"pack_linears: the packed kernel could not be built ({unavailable_reason()})")
    graph = gm.graph
    linears = [n for n in graph.nodes if n.op == "call_function" and n.target is LINEAR]
    names: dict = {}  # weight attribute -> its panels' buffer (a weight read by several linears)
    rewritten, panel_bytes, calls, quantized = 0, 0, 0, 0
    joined: set = set()  # the linears a joined call replaced

    def hold(name: str, held: torch.Tensor) -> None:
        nonlocal panel_bytes
        if hasattr(gm, name):
            raise PassError(f"pack_linears: the module already has an attribute {name!r}")
        gm.register_buffer(name, held, persistent=False)
        panel_bytes += held.numel() * held.element_size()

    for nodes in groups(gm) if join else []:  # the linears of one input, each a float32 weight: one call
        weights = [_packable_weight(gm, node) for node in nodes]
        if any(w is None for w in weights):
            continue
        name = ATTRIBUTE_PREFIX + "joined_" + nodes[0].args[1].target.replace(".", "_")
        hold(name, panels(weights[0], narrow, *weights[1:]))
        names.update((node.args[1].target, name) for node in nodes)
        widths = [w.shape[0] for w in weights]
        with graph.inserting_before(nodes[0]):
            out = _packed_call(graph, nodes[0].args[0], name, sum(widths), weights[0].shape[1],
                              weights[0].dtype)  # [..., sum N_i]
            if _bias(nodes[0]) is not None:  # all present (groups' key): added joined
                biases = [graph.get_attr(_bias(node).target) for node in nodes]
                out = graph.call_function(aten.add.Tensor, (out, graph.call_function(aten.cat.default, (biases,))))
        slice_back(graph, out, nodes, widths)
        joined.update(nodes)
        rewritten, calls = rewritten + len(nodes), calls + 1
    others = [(n, w) for n in linears if n not in joined and (w := _packable_weight(gm, n)) is not None]
    for node, weight in others:
        weight_node, bias = node.args[1], _bias(node)
        name = names.get(weight_node.target)
        if name is None:
            name = names[weight_node.target] = ATTRIBUTE_PREFIX + weight_node.target.replace(".", "_")
            hold(name, panels(weight, narrow))
        with graph.inserting_before(node):
            out = _packed_call(graph, node.args[0], name, *weight.shape, weight.dtype)  # [..., N]
            if bias is not None:
                out = graph.call_function(aten.add.Tensor, (out, bias))
        replace_node(graph, node, out)
        rewritten, calls = rewritten + 1, calls + 1
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target is QUANTIZED_LINEAR]:
        x, packed, scales, n, *rest = node.args  # quantize_weights' panels: the kernel reads them as they are
        bias = rest[0] if rest else node.kwargs.get("bias")
        dtype = getattr(x.meta.get("val"), "dtype", torch.float32)
        with graph.inserting_before(node):
            out = _packed_call(graph, x, packed.target, n, _value_shape(x)[-1], dtype, scales.target)  # [..., N]
            if bias is not None:
                out = graph.call_function(aten.add.Tensor, (out, bias))
        replace_node(graph, node, out)
        calls, quantized = calls + 1, quantized + 1
    for node in list(graph.nodes):  # the float32 weights' reads no linear takes now
        if node.op == "get_attr" and not node.users and not node.target.startswith(ATTRIBUTE_PREFIX):
            graph.erase_node(node)
    dropped = drop_unread_attributes(gm, names)  # the stage module holds the panels only
    if rewritten != len(linears):
        log.warning("pack_linears: %d of %d linears left as they were (not a 2-D float32, float16 or bfloat16 "
                    "weight attribute of their input's dtype and known input rank)", len(linears) - rewritten,
                    len(linears))
    graph.lint()
    gm.recompile()
    log.info("pack_linears: %d linears packed into %d calls, %.1f MiB of panels, %.1f MiB of weights no longer held",
             rewritten + quantized, calls, panel_bytes / 2**20, dropped / 2**20)
    return gm


class PackLinears(GraphPass):
    name = "pack_linears"
    requires = frozenset()
    requires_nothing_because = "each linear node is replaced by its own definition, whatever surrounds it"
    guarantees = frozenset({LINEARS_PACKED})

    def __init__(self, narrow: bool = True, join: bool = True):
        self.narrow, self.join = narrow, join

    def run(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        return pack_linears(gm, self.narrow, self.join)
