"""Pass ``narrow_weights``: float32 weights whose values are all exactly float16 (or bfloat16) held so.

Each ``get_attr`` of a :func:`narrowable` weight with an exact :func:`narrow_copy` (not marked
:data:`DTYPE_DECIDED`) reads that copy, a buffer shared by every stage, widened by
``prims.convert_element_type``; the float32 attribute is dropped. Bit for bit in eager, up to rounding order
under Inductor; never before a BLAS call, which would copy the weight wide each call
(docs/measurements/2026-12-03-narrow-weights.md). Requires nothing; guarantees ``weights_narrowed``.
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
# float32 tensor -> (its version, its narrow copy or None where none is exact)
_NARROWED = WeakIdKeyDictionary()


def narrow_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """:func:`exact_narrow` of ``weight``, computed once per tensor and version."""
    known = _NARROWED.get(weight)
    if known is not None and known[0] == version(weight):
        return known[1]
    found = exact_narrow(weight)
    _NARROWED[weight] = (version(weight), found)
    return found


def exact_narrow(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` in the first of :data:`NARROW_DTYPES` holding each value exactly, made afresh; else None."""
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
    """A float32 tensor of at least :data:`MIN_ELEMENTS` values, not one a pass made (``saguaro_*``)."""
    return (
        isinstance(value, torch.Tensor)
        and value.dtype == torch.float32
        and value.numel() >= MIN_ELEMENTS
        and not name.startswith(SAGUARO_PREFIX)
    )


def narrow_weights(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Rewrite each read of a narrowable weight of ``gm`` as its narrow copy widened; returns ``gm``."""
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
