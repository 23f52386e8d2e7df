"""Pass ``last_row_head``: the LM head over the last row only, where the stage reads only that row's logits.

Where every read of the logits (:data:`~saguaro.passes.splice_epilogue.LOGITS_NODE`) is ``logits[:, -1]``
and they come from an ``aten.linear`` over ``[B, T, H]`` through :data:`ROW_LOCAL` operations only, that
linear reads ``x[:, -1:]`` (the last row bit for bit on the packed kernel, up to rounding on BLAS); other
graphs are left. Requires ``epilogue_spliced``; guarantees ``head_last_row``. Measured:
docs/measurements/2026-12-06-prefill-and-draft-feed.md.
"""

from __future__ import annotations

import logging
import operator

import torch

from saguaro.capture.graph_file import TensorSpec
from saguaro.passes.base.graph_pass import EPILOGUE_SPLICED, HEAD_LAST_ROW, GraphPass
from saguaro.passes.splice_epilogue import LOGITS_NODE
from saguaro.tensor_math.quantized_linear import QUANTIZED_LINEAR

log = logging.getLogger(__name__)

aten, prims = torch.ops.aten, torch.ops.prims
LINEAR = aten.linear.default
ROW_LOCAL = {
    aten._to_copy.default,
    aten.to.dtype,
    prims.convert_element_type.default,
    aten.alias.default,
    aten.clone.default,
    aten.tanh.default,
    aten.mul.Tensor,
    aten.div.Tensor,
    aten.mul.Scalar,
    aten.div.Scalar,
}  # each output row from the same input row (a scalar operand at most)
END = 9223372036854775807  # a slice to the end, as torch.export writes it


def _reads_last_row(user: torch.fx.Node) -> bool:
    """``user`` is ``logits[:, -1]``."""
    if user.op != "call_function":
        return False
    if user.target is operator.getitem and len(user.args) == 2:
        index = user.args[1]
        return isinstance(index, tuple) and len(index) == 2 and index[0] == slice(None) and index[1] == -1
    return user.target is aten.select.int and tuple(user.args[1:]) == (1, -1)


def _head(logits: torch.fx.Node) -> tuple[torch.fx.Node | None, list]:
    """The linear the logits come from and the row-local nodes between (logits first); None when anything
    else, or another reader of an intermediate value, stands between."""
    chain, node = [], logits
    while node.op == "call_function" and node.target not in (LINEAR, QUANTIZED_LINEAR):
        operands = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, torch.fx.Node)]
        if node.target not in ROW_LOCAL or operands != [node.args[0]] or len(node.args[0].users) != 1:
            return None, chain
        chain.append(node)
        node = node.args[0]
    return (node if node.op == "call_function" else None), chain


def _last_row_value(node: torch.fx.Node):
    """``node``'s ``val`` (a fake tensor or a graph file's ``TensorSpec``) for its last row ``[B, 1, ...]``;
    None when it has none of rank 3."""
    value = node.meta.get("val")
    if isinstance(value, TensorSpec) and len(value.shape) == 3:
        return value._replace(shape=(value.shape[0], 1, value.shape[2]))
    if isinstance(value, torch.Tensor) and value.dim() == 3:
        return value[:, -1:]
    return None


def last_row_head(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    logits = next((n for n in gm.graph.nodes if n.meta.get(LOGITS_NODE)), None)
    if logits is None or not logits.users or not all(_reads_last_row(u) for u in logits.users):
        return gm
    head, chain = _head(logits)
    x = head.args[0] if head is not None else None
    # later passes read the head input's rank from its value metadata: without one they would skip the head
    value = _last_row_value(x) if isinstance(x, torch.fx.Node) else None
    if value is None:
        log.debug(
            "last_row_head: the logits do not come from a linear over [B, T, H] rows of known shape; left"
        )
        return gm
    with gm.graph.inserting_before(head):
        last = gm.graph.call_function(aten.slice.Tensor, (x, 1, -1, END))  # [B, 1, H]
    last.meta["val"] = value
    head.replace_input_with(x, last)
    for node in (head, *reversed(chain)):
        if (value := _last_row_value(node)) is not None:
            node.meta["val"] = value
    gm.graph.lint()
    gm.recompile()
    log.debug("last_row_head: the head reads the last row only")
    return gm


class LastRowHead(GraphPass):
    name = "last_row_head"
    requires = frozenset({EPILOGUE_SPLICED})
    guarantees = frozenset({HEAD_LAST_ROW})

    def run(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        return last_row_head(gm)
