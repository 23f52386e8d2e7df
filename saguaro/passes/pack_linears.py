"""Pass ``pack_linears``: each linear as the packed few-row kernel over its weight's panels.

Every ``aten.linear`` over a weight :func:`_packable_weight` accepts becomes ``saguaro_kernels.packed_linear``
over its :func:`panels` (+ bias), every ``saguaro::quantized_linear`` ``packed_linear_q``; with ``join`` the
linears of one input (``fuse_projections``' groups) are one call, sliced back. Outputs are the same bits
whatever ``narrow``, the join or the row count, equal to BLAS up to rounding; others are left, with a warning.
See docs/measurements/2026-12-04-packed-few-row-kernel.md, docs/measurements/2026-12-06-packed-one-row.md.

Requires nothing; guarantees ``linears_packed``. ``PassError`` where the kernel does not build.
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
# weight (a group's first) -> {(the others' ids, the group's versions, narrow): panels}
_PACKED = WeakIdKeyDictionary()


def panels(weight: torch.Tensor, narrow: bool, *others: torch.Tensor) -> torch.Tensor:
    """The panels ``[P, K, 64]`` of ``weight [N, K]`` (and ``others`` joined along N), on huge pages where
    possible: float16 / bfloat16 where ``narrow`` and exact, else as held; made once per group, versions and
    ``narrow``, no narrow or joined copy kept."""
    parts = (weight, *others)
    known = _PACKED.setdefault(weight, {})
    key = (tuple(id(t) for t in others), tuple(version(t) for t in parts), narrow)
    if key not in known:
        # an older version's panels are stale
        known.pop(next((k for k in known if k[0] == key[0]), None), None)
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
    """The weight of linear ``node`` if it is a 2-D attribute of :data:`PACKED_DTYPES` matching its input's
    dtype and last size; else None."""
    weight_node, x_shape = node.args[1], _value_shape(node.args[0])
    weight = get_attribute(gm, weight_node.target) if weight_node.op == "get_attr" else None
    x_dtype = (
        getattr(node.args[0].meta.get("val"), "dtype", None)
        if isinstance(node.args[0], torch.fx.Node)
        else None
    )
    if (
        not isinstance(weight, torch.Tensor)
        or weight.dim() != 2
        or weight.dtype not in PACKED_DTYPES
        or x_dtype not in (None, weight.dtype)
        or not x_shape
        or x_shape[-1] != weight.shape[1]
    ):
        return None
    return weight


def _bias(node: torch.fx.Node):
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")


def _packed_call(
    graph: torch.fx.Graph,
    x: torch.fx.Node,
    panels_name: str,
    n: int,
    k: int,
    dtype: torch.dtype = torch.float32,
    scales_name: str | None = None,
) -> torch.fx.Node:
    """Nodes computing ``x [..., K]`` times the weight held as panels ``panels_name``: ``[..., N]`` in
    ``dtype`` (a 16-bit ``x`` widened for the kernel); with ``scales_name``, quantized panels."""
    call = graph.call_function
    leading = [call(aten.sym_size.int, (x, d)) for d in range(len(_value_shape(x)) - 1)]  # x's "..."
    rows = call(aten.reshape.default, (x, [-1, k]))  # [M, K]
    if dtype != torch.float32:
        rows = call(prims.convert_element_type.default, (rows, torch.float32))
    if scales_name is None:
        out = call(
            torch.ops.saguaro_kernels.packed_linear.default, (rows, graph.get_attr(panels_name), n)
        )  # [M, N]
    else:
        out = call(
            torch.ops.saguaro_kernels.packed_linear_q.default,
            (rows, graph.get_attr(panels_name), graph.get_attr(scales_name), n),
        )  # [M, N]
    if dtype != torch.float32:
        out = call(prims.convert_element_type.default, (out, dtype))
    return call(aten.reshape.default, (out, [*leading, n]))  # [..., N]


def pack_linears(gm: torch.fx.GraphModule, narrow: bool = True, join: bool = True) -> torch.fx.GraphModule:
    """Rewrite the linears of ``gm`` as the packed kernel (``join``: one call per group); returns ``gm``."""
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
            out = _packed_call(
                graph, nodes[0].args[0], name, sum(widths), weights[0].shape[1], weights[0].dtype
            )  # [..., sum N_i]
            if _bias(nodes[0]) is not None:  # all present (groups' key): added joined
                biases = [graph.get_attr(_bias(node).target) for node in nodes]
                out = graph.call_function(
                    aten.add.Tensor, (out, graph.call_function(aten.cat.default, (biases,)))
                )
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
            out = _packed_call(
                graph, x, packed.target, n, _value_shape(x)[-1], dtype, scales.target
            )  # [..., N]
            if bias is not None:
                out = graph.call_function(aten.add.Tensor, (out, bias))
        replace_node(graph, node, out)
        calls, quantized = calls + 1, quantized + 1
    for node in list(graph.nodes):  # the float32 weights' reads no linear takes now
        if node.op == "get_attr" and not node.users and not node.target.startswith(ATTRIBUTE_PREFIX):
            graph.erase_node(node)
    dropped = drop_unread_attributes(gm, names)  # the stage module holds the panels only
    if rewritten != len(linears):
        log.warning(
            "pack_linears: %d of %d linears left as they were (not a 2-D float32, float16 or bfloat16 "
            "weight attribute of their input's dtype and known input rank)",
            len(linears) - rewritten,
            len(linears),
        )
    graph.lint()
    gm.recompile()
    log.info(
        "pack_linears: %d linears packed into %d calls, %.1f MiB of panels, %.1f MiB of weights no longer held",
        rewritten + quantized,
        calls,
        panel_bytes / 2**20,
        dropped / 2**20,
    )
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
