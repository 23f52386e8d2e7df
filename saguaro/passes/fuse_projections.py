"""Pass ``fuse_projections``: the linears that read one input joined into one linear, sliced back.

Each of :func:`groups` (q/k/v, gate/up) becomes ``linear(x, cat(W_i), cat(b_i))[..., o_i : o_i + N_i]`` over
a weight joined once and shared by every stage (:func:`joined`); other linears are left alone. Exact before
reductions, never before a CPU BLAS GEMM (:func:`fusion_applies`; docs/design.md's pass table,
docs/measurements/2026-12-04-fuse-projections.md). Requires nothing, but refuses to run after
``linear_as_reduction`` (``PassError``); guarantees ``projections_fused``.
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from saguaro.passes.base.graph_pass import LINEARS_AS_REDUCTIONS, PROJECTIONS_FUSED, GraphPass, PassRecord
from saguaro.passes.base.graph_splice import PassError, get_attribute
from saguaro.passes.narrow_weights import DTYPE_DECIDED, exact_narrow, narrowable

log = logging.getLogger(__name__)

aten = torch.ops.aten
LINEAR = aten.linear.default
VIEWS = (aten.view.default, aten._unsafe_view.default)  # a column slice may not allow them: reshape instead
ATTRIBUTE_PREFIX = "saguaro_joined_"  # the stage module's buffer holding a joined weight or bias
# Joined by default on Inductor's stages on CUDA (fewer kernels a layer; not yet run on a GPU, where it may
# change rounding: benchmarks/gpu_probe.py checks greedy equality). Off on a CPU: exact but slower.
FUSE_ON_CUDA = True
_JOINED = WeakIdKeyDictionary()  # first tensor -> {narrow: (weak refs and versions of the parts, joined)}


def fusion_applies(backend: str, device_type: str, linears: str, requested: bool | None = None) -> bool:
    """Whether a stage of ``backend``, ``device_type`` and ``linears`` joins: ``requested`` None, Inductor on
    CUDA when :data:`FUSE_ON_CUDA`; True, there and wherever the linears are reductions; False, never."""
    on_cuda = backend == "inductor" and device_type == "cuda"
    if requested is None:
        return FUSE_ON_CUDA and on_cuda
    return requested and (on_cuda or linears == "reduction")


def joined(parts: tuple, narrow: bool = False) -> torch.Tensor | None:
    """``parts`` joined along dim 0, once per tensors and versions, as :func:`held_dtype` with ``narrow``;
    None where they would be held in different dtypes (Inductor vectorises by the dtypes it loads)."""
    entries = _JOINED.setdefault(parts[0], {})
    known = entries.get(narrow)
    if (
        known is not None
        and len(known[0]) == len(parts)
        and all(ref() is t and version == t._version for (ref, version), t in zip(known[0], parts))
    ):
        return known[1]
    dtypes = {held_dtype(t) if narrow else t.dtype for t in parts}
    whole = None
    if len(dtypes) == 1:
        with torch.no_grad():  # exact: every part's values are values of the dtype
            whole = torch.cat([t.detach().to(*dtypes) for t in parts])
    entries[narrow] = ([(weakref.ref(t), t._version) for t in parts], whole)
    return whole


def held_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype ``narrow_weights`` holds ``weight`` in: float16 / bfloat16 where narrowable and exact."""
    narrow = exact_narrow(weight) if narrowable(weight) else None
    return weight.dtype if narrow is None else narrow.dtype


def _operands(gm: torch.fx.GraphModule, node: torch.fx.Node):
    """``(weight node, bias node or None, key)`` of a linear that can join others; None otherwise."""
    weight = node.args[1]
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    held = [n for n in (weight, bias) if n is not None]
    if not all(isinstance(n, torch.fx.Node) and n.op == "get_attr" for n in held):
        return None
    w = get_attribute(gm, weight.target)
    if not isinstance(w, torch.Tensor) or w.ndim != 2:
        return None
    if bias is not None and getattr(get_attribute(gm, bias.target), "ndim", None) != 1:
        return None
    return weight, bias, (w.shape[1], w.dtype, w.device, bias is not None)


def groups(gm: torch.fx.GraphModule) -> list[list[torch.fx.Node]]:
    """The groups it joins, graph order: two or more linears of one input node, with held 2-D weights of one
    K, dtype and device and all or none with a held 1-D bias."""
    found: dict = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is LINEAR:
            operands = _operands(gm, node)
            if operands is not None:
                found.setdefault((node.args[0], operands[2]), []).append(node)
    return [nodes for nodes in found.values() if len(nodes) > 1]


def _read(gm: torch.fx.GraphModule, whole: torch.Tensor, name: str, dtype: torch.dtype) -> torch.fx.Node:
    """A node reading ``whole`` (registered as buffer ``name`` of ``gm``) as ``dtype``, marked
    :data:`~saguaro.passes.narrow_weights.DTYPE_DECIDED`; ``PassError`` if ``name`` is taken."""
    if hasattr(gm, name):
        raise PassError(f"fuse_projections: the module already has an attribute {name!r}")
    gm.register_buffer(name, whole, persistent=False)
    node = gm.graph.get_attr(name)
    node.meta[DTYPE_DECIDED] = True
    if whole.dtype == dtype:
        return node
    wide = gm.graph.call_function(torch.ops.prims.convert_element_type.default, (node, dtype))
    # linear_as_reduction reads the weight's shape from "val": the float32 joined weight's own
    wide.meta["val"] = torch.empty(whole.shape, dtype=dtype, device="meta")
    return wide


def _join(gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], narrow: bool) -> bool:
    """Join one group (:func:`groups`); False, leaving it as it was, where :func:`joined` refuses."""
    graph = gm.graph
    operands = [_operands(gm, n) for n in nodes]
    weights = tuple(get_attribute(gm, w.target) for w, _, _ in operands)
    whole = joined(weights, narrow)
    if whole is None:
        return False
    name = ATTRIBUTE_PREFIX + nodes[0].args[1].target.replace(".", "_")
    dtype = weights[0].dtype
    with graph.inserting_before(nodes[0]):
        weight = _read(gm, whole, name, dtype)
        bias = None
        if operands[0][1] is not None:  # biases as they are: small, read once a call
            bias = _read(
                gm, joined(tuple(get_attribute(gm, b.target) for _, b, _ in operands)), name + "_bias", dtype
            )
        fused = graph.call_function(LINEAR, (nodes[0].args[0], weight, bias))  # [..., sum N_i]
    fused.meta.update({k: v for k, v in nodes[0].meta.items() if k in ("nn_module_stack", "stack_trace")})
    slice_back(graph, fused, nodes, [w.shape[0] for w in weights])
    return True


def slice_back(
    graph: torch.fx.Graph, fused: torch.fx.Node, nodes: list[torch.fx.Node], widths: list[int]
) -> None:
    """Replace each of ``nodes`` (graph order) by its column slice of ``fused [..., sum widths]``."""
    start = 0
    for node, width in zip(nodes, widths):
        with graph.inserting_before(node):
            part = graph.call_function(aten.slice.Tensor, (fused, -1, start, start + width))  # [..., N_i]
        part.meta.update(node.meta)
        start += width
        for user in list(node.users):
            if user.op == "call_function" and user.target in VIEWS:
                user.target = aten.reshape.default
        node.replace_all_uses_with(part)
        graph.erase_node(node)


def fuse_projections(gm: torch.fx.GraphModule, narrow: bool = False) -> torch.fx.GraphModule:
    """Join every group of linears of ``gm`` that read one input (:func:`groups`); returns ``gm``."""
    found = [nodes for nodes in groups(gm) if _join(gm, nodes, narrow)]
    for node in list(gm.graph.nodes):  # the parts' weight reads that nothing reads any more
        if node.op == "get_attr" and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    log.info("fuse_projections: %d linears joined into %d", sum(map(len, found)), len(found))
    return gm


class FuseProjections(GraphPass):
    """The pass; ``narrow``: keep each joined weight narrow where exact."""

    name = "fuse_projections"
    requires = frozenset()
    requires_nothing_because = (
        "each group of linears is replaced by one whose slices compute the same outputs"
    )
    guarantees = frozenset({PROJECTIONS_FUSED})

    def __init__(self, narrow: bool = False):
        self.narrow = narrow

    def check(self, record: PassRecord) -> None:
        super().check(record)
        if LINEARS_AS_REDUCTIONS in record.facts:
            raise PassError(
                f"fuse_projections must run before linear_as_reduction, which leaves no aten.linear to "
                f"join (passes before it: {', '.join(record.ran)})"
            )

    def run(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        return fuse_projections(gm, self.narrow)
