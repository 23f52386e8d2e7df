"""Pass: the linears that read one input (an attention layer's q / k / v projections, an MLP's gate / up)
joined into one linear over their weights concatenated along N, its output sliced back.

A decode step calls one kernel per linear: joining q, k and v into one and gate and up into one removes
three of a layer's seven projection kernels (launches on a GPU, one weight-streaming loop each on a CPU).
Every group of at least two ``aten.linear`` nodes that read the same input node, whose weights are 2-D
tensors the graph holds (``get_attr``) of one K, dtype and device, and whose biases are all present (1-D
tensors the graph holds) or all absent, becomes

    y = linear(x [..., K], cat(W_1 .. W_n) [N, K], cat(b_1 .. b_n))   ->   y[..., o_i : o_i + N_i]   for each i

and each original node's users read its slice (a column view: a ``view`` that reads one directly becomes
a ``reshape``, a copy only where the slice's strides do not allow the view). Any other linear is left alone.
The weights themselves are not touched: the joined copy is taken once per weight tensor and version and
shared by every stage graph that joins them (:data:`_JOINED`, dropped with the first weight), so a model's
projection weights are held twice (model and joined copy), not once per stage: on CUDA, for a model whose
weights are its projections mostly (an 8B Llama: 4.6 of its 8 billion), 1.6 times the model's
bytes; making the model's own parameters views into the joined copy would avoid it (not done: it would
change the user's model, whose parameters would then share memory when saved). With ``narrow`` (the stages
``narrow_weights`` runs on) the joined copy is held in the dtype that pass would hold each part in (float16 /
bfloat16 where every value is exactly one, read through a widening to float32; the float32 joined copy is
never kept), and ``narrow_weights`` leaves it so; a group whose parts it would hold in different dtypes (a
part under its 4096 values, say) is not joined: Inductor's C++ kernels vectorise by the dtypes they load,
and a stage reading a weight as float16 was measured not bit-equal to one reading it as float32.

Exactness, per lowering form. Output ``[m, o_i + n]`` of the joined linear reads the same ``x[m, :]`` and
``W_i[n, :]`` as output ``[m, n]`` of linear ``i``; whether it sums them in the same order is the kernel's:

* ``linear_as_reduction`` (the few-row stages of Inductor on a CPU; ``linears="reduction"``): each output is
  the sum over K of an elementwise product; ATen's reduction (eager) and Inductor's C++ reduction (the
  weight's rows the outer, parallel loop, K the inner, vectorised one) order a sum by K and the layout, not
  by N. Stage outputs are bit-equal joined and not (``tests/passes/test_fuse_projections.py``: every tested
  family in eager; a Llama's step and verify compiled; by hand, those at one, two and four threads).
* a BLAS GEMM (``aten.linear`` as captured: MKL on a CPU): the library picks blocking, kernels and the
  threads' split by shape. On this CPU MKL gave equal bits at one and two threads for every shape tried,
  but not at four and eight threads for K=100, N=60+20+20 (differences of 1e-5): not exact, not applied.
* CUDA (Inductor's stages, :data:`FUSE_ON_CUDA`): on by default, for fewer kernels a layer (issue 42); never
  run on a GPU yet. cuBLAS and Inductor's Triton reductions also choose their kernels by shape, so the joined stage is
  not guaranteed bit-equal to the unjoined one: like Inductor's other fusions on CUDA it may change rounding,
  and greedy equality with ``generate`` is what ``benchmarks/gpu_probe.py``'s exactness part checks.

Speed: off by default on a CPU (``fusion_applies``), where it is exact but slower for the reductions; the packed
stages (every stage of Inductor on a CPU by default) join the same groups in ``pack_linears`` instead. Inductor
already runs the reductions of q, k and v of one width (and of gate and up) as one loop over the weights' rows with an
accumulator each, computing their shared input (the RMSNorm, inlined) once per row for all three; joined, it
computes it once per row of the joined weight, three times as often. The default pair's target (one thread,
min of 30 alternating batches, the machine loaded by other work): step 3.56 ms apart against 4.85 joined,
verify 17.0 against 24.2; ``benchmarks/parts/fuse_projections.py``: AR 0.75x, SD 0.76x.

Tensor parallelism: ``shard_tensor_parallel`` runs in the base pipeline, before every stage pass, so this
pass joins a rank's own slices. Requires nothing, but must run before ``linear_as_reduction`` (which leaves
no ``aten.linear``): :meth:`FuseProjections.check` refuses a graph whose linears are reductions already.
Guarantees ``projections_fused``.
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
# Where a builder joins by default: Inductor's stages on CUDA (never run on a GPU yet; see above). Not on a CPU,
# where it is exact but slower (see above).
FUSE_ON_CUDA = True
_JOINED = WeakIdKeyDictionary()  # first tensor -> {narrow: (weak refs and versions of the parts, joined)}


def fusion_applies(backend: str, device_type: str, linears: str, requested: bool | None = None) -> bool:
    """Whether a stage whose linears run as ``linears`` (``lowering.linear_implementation``'s answer) on
    ``backend`` and ``device_type`` joins its projections. ``requested`` None (the default): Inductor's stages
    on CUDA (:data:`FUSE_ON_CUDA`); True: those, and every stage whose linears are reductions (where it is
    exact; slower than apart on a CPU's Inductor); False: none. Never before a CPU BLAS GEMM (not exact)."""
    on_cuda = backend == "inductor" and device_type == "cuda"
    if requested is None:
        return FUSE_ON_CUDA and on_cuda
    return requested and (on_cuda or linears == "reduction")


def joined(parts: tuple, narrow: bool = False) -> torch.Tensor | None:
    """``parts`` concatenated along dim 0, computed once per tuple of tensors and their versions; with
    ``narrow``, in the dtype ``narrow_weights`` would hold each part in (:func:`held_dtype`); None when the
    parts would be held in different dtypes (they are not joined: see the module docstring)."""
    entries = _JOINED.setdefault(parts[0], {})
    known = entries.get(narrow)
    if known is not None and len(known[0]) == len(parts) and all(
            ref() is t and version == t._version for (ref, version), t in zip(known[0], parts)):
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
    """``(weight node, bias node or None, key)`` of a linear that can join others (its weight a held 2-D
    tensor, its bias a held 1-D one or none); None otherwise. Linears of one input and key can join."""
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
    """The linears this pass joins, in graph order: each group two or more that read one input node."""
    found: dict = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is LINEAR:
            operands = _operands(gm, node)
            if operands is not None:
                found.setdefault((node.args[0], operands[2]), []).append(node)
    return [nodes for nodes in found.values() if len(nodes) > 1]


def _read(gm: torch.fx.GraphModule, whole: torch.Tensor, name: str, dtype: torch.dtype) -> torch.fx.Node:
    """A node reading ``whole`` (a buffer of ``gm`` named ``name``) as ``dtype``, marked so that
    ``narrow_weights`` leaves it as it is (its dtype is the one that pass would hold each part in)."""
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
    """Join one group (:func:`groups`); False, leaving it as it was, when its weights would be held in
    different dtypes."""
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
            bias = _read(gm, joined(tuple(get_attribute(gm, b.target) for _, b, _ in operands)), name + "_bias", dtype)
        fused = graph.call_function(LINEAR, (nodes[0].args[0], weight, bias))  # [..., sum N_i]
    fused.meta.update({k: v for k, v in nodes[0].meta.items() if k in ("nn_module_stack", "stack_trace")})
    slice_back(graph, fused, nodes, [w.shape[0] for w in weights])
    return True


def slice_back(graph: torch.fx.Graph, fused: torch.fx.Node, nodes: list[torch.fx.Node], widths: list[int]) -> None:
    """Replace each of ``nodes`` (in graph order) by its column slice of ``fused [..., sum widths]`` and erase it;
    a ``view`` that reads one becomes a ``reshape`` (the slice's strides may not allow the view)."""
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
    """The pass (see the module docstring); ``narrow``: keep each joined weight narrow where exact."""

    name = "fuse_projections"
    requires = frozenset()
    requires_nothing_because = "each group of linears is replaced by one whose slices compute the same outputs"
    guarantees = frozenset({PROJECTIONS_FUSED})

    def __init__(self, narrow: bool = False):
        self.narrow = narrow

    def check(self, record: PassRecord) -> None:
        super().check(record)
        if LINEARS_AS_REDUCTIONS in record.facts:
            raise PassError(f"fuse_projections must run before linear_as_reduction, which leaves no aten.linear to "
                            f"join (passes before it: {', '.join(record.ran)})")

    def run(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        return fuse_projections(gm, self.narrow)
