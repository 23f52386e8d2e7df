"""Pass: each float32 weight whose values are all exactly float16 (or bfloat16) stored in that dtype,
widened back to float32 where the graph reads it.

A decode step streams every weight of the model from memory once per call (``linear_as_reduction``):
its time is the weights' bytes over the memory's rate. Most checkpoints are published in float16 or
bfloat16 and loaded as float32 for a CPU, so every float32 value is one of the narrower dtype's: the
float32 copy spends half its bytes on zero bits. This pass keeps, for each weight matrix the graph reads
(a ``get_attr`` of a float32 tensor of at least :data:`MIN_ELEMENTS` elements), the narrow copy instead,
and converts it back to float32 right after the read (``prims.convert_element_type``). The conversion is
exact (every float16 and bfloat16 value is a float32 value), so the stage computes float32 products and
sums of the same values: run op by op (eager) the outputs are unchanged, bit for bit. Compiled by Inductor
they are equal up to float32 rounding order only, not bit for bit: its C++ kernels pick their vector width
by the narrowest float dtype they load (16 float16 lanes where float32 takes 8 on AVX2), so a reduction
reading a narrow weight adds its products in another order (measured on a tiny Llama's step: logits and
caches about 1e-7 apart; the greedy tokens are tested equal to ``generate``, ``tests/lower/test_inductor.py``).
Inductor has no setting that picks the float32 width for these kernels. Inductor fuses the conversion into
the kernels that read the weight (the reductions of ``linear_as_reduction``, the embedding's gather), so
each call reads half the bytes: the default pair's target then fits this machine's L3 cache
(``benchmarks/README.md``).

A weight is narrowed only when converting it to the narrow dtype and back gives every value unchanged
(NaN never compares equal, so a weight holding one stays as it is); float16 is tried first, then bfloat16.
A read marked :data:`DTYPE_DECIDED` (``fuse_projections``' joined weights, held in the dtype this pass would
hold each of their parts in) is left as it is.
The check runs once per weight tensor and version and its narrow copy is shared by every stage graph that
reads it (:data:`_NARROWED`, keyed by the tensor, dropped with it). A stage holds the copy taken when it was
built: a weight changed in place afterwards is not seen by the stages built before (as frozen weights are
not); stages built after the change (a new ``saguaro.compile``) take a new copy (the tensor's version moved).

Meant for graphs whose weight reads fuse into the kernels that use them: ``saguaro.compile`` runs it on
Inductor's stages whose linears are reductions (``SaguaroConfig.narrow_weights``); before a BLAS call
(``aten.linear``, ``aten.mm``) the conversion would write a float32 copy of the weight on every call.

Requires: nothing (each weight read is replaced by an exact equivalent). Guarantees: ``weights_narrowed``.
"""

from __future__ import annotations

import logging

import torch
from torch.utils.weak import WeakIdKeyDictionary

from saguaro.passes.base.graph_pass import WEIGHTS_NARROWED, GraphPass
from saguaro.passes.base.graph_splice import PassError, drop_unread_attributes, get_attribute

log = logging.getLogger(__name__)

NARROW_DTYPES = (torch.float16, torch.bfloat16)  # tried in this order
MIN_ELEMENTS = 4096  # smaller tensors (norm scales, biases) are not worth a conversion node
SAGUARO_PREFIX = "saguaro_"  # the attributes Saguaro's passes add
ATTRIBUTE_PREFIX = SAGUARO_PREFIX + "narrow_"  # the stage module's buffer holding a narrow copy
DTYPE_DECIDED = "saguaro_dtype_decided"  # a get_attr's meta: its dtype was chosen already (fuse_projections)
_NARROWED = WeakIdKeyDictionary()  # float32 tensor -> (its version, its narrow copy or None where none is exact)


def narrow_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` (float32) in the first of :data:`NARROW_DTYPES` that holds every value exactly; None when
    neither does. Computed once per tensor and version (an in-place change moves ``weight._version``)."""
    known = _NARROWED.get(weight)
    if known is not None and known[0] == version(weight):
        return known[1]
    found = exact_narrow(weight)
    _NARROWED[weight] = (version(weight), found)
    return found


def exact_narrow(weight: torch.Tensor) -> torch.Tensor | None:
    """:func:`narrow_copy` computed afresh, not kept (``fuse_projections`` keeps its joined copies itself)."""
    with torch.no_grad():
        for dtype in NARROW_DTYPES:
            narrow = weight.detach().to(dtype)
            if torch.equal(narrow.to(torch.float32), weight):
                return narrow
    return None


def version(weight: torch.Tensor) -> int:
    """``weight``'s in-place change counter (an inference tensor has none: 0)."""
    return 0 if weight.is_inference() else weight._version


def narrowable(value, name: str = "") -> bool:
    """A float32 tensor big enough to narrow, not a form a pass already made (``saguaro_*``: narrow copies,
    packed panels)."""
    return (isinstance(value, torch.Tensor) and value.dtype == torch.float32 and value.numel() >= MIN_ELEMENTS
            and not name.startswith(SAGUARO_PREFIX))


def narrow_weights(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rewrite every read of a narrowable float32 weight of ``gm`` as a read of its narrow copy (a buffer of
    ``gm``) converted back to float32; returns ``gm``."""
    graph = gm.graph
    narrowed, saved = 0, 0
    attributes: dict = {}  # get_attr target -> the narrow buffer's name (a weight read by several nodes)
    for node in list(graph.nodes):
        if node.op != "get_attr" or node.meta.get(DTYPE_DECIDED):
            continue
        weight = get_attribute(gm, node.target)
        narrow = narrow_copy(weight) if narrowable(weight, node.target) else None
        if narrow is None:
            continue
        name = attributes.get(node.target)
        if name is None:
            name = attributes[node.target] = ATTRIBUTE_PREFIX + node.target.replace(".", "_")
            if hasattr(gm, name):
                raise PassError(f"narrow_weights: the module already has an attribute {name!r}")
            gm.register_buffer(name, narrow, persistent=False)
            saved += weight.numel() * (weight.element_size() - narrow.element_size())
        with graph.inserting_before(node):
            read = graph.get_attr(name)
            wide = graph.call_function(torch.ops.prims.convert_element_type.default, (read, torch.float32))
        # later passes read shapes from "val" (linear_as_reduction's ranks): the float32 weight's own
        wide.meta["val"] = torch.empty(weight.shape, dtype=torch.float32, device="meta")
        node.replace_all_uses_with(wide)
        graph.erase_node(node)
        narrowed += 1
    drop_unread_attributes(gm, attributes)  # the stage module holds the narrow copies only
    graph.lint()
    gm.recompile()
    log.info("narrow_weights: %d weight reads narrowed, %.1f MiB fewer bytes a call", narrowed, saved / 2**20)
    return gm


class NarrowWeights(GraphPass):
    name = "narrow_weights"
    requires = frozenset()
    requires_nothing_because = "each weight read is replaced by an exact equivalent, whatever reads it"
    guarantees = frozenset({WEIGHTS_NARROWED})

    def run(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        return narrow_weights(gm)
