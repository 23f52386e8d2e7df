"""Pass ``splice_epilogue``: the stage's epilogue spliced after the logits; the stage returns its results.

The graph takes ``stage.inputs`` after its own and returns ``stage.outputs``, the stage table's epilogue of
``(logits, *reads, *inputs)`` (a ranked one with the width baked in); the logits node is marked
:data:`LOGITS_NODE`. Requires ``flat_signature`` and ``logits_output`` (invalidated); guarantees
``epilogue_spliced``. ``PassError`` for a missing read or another output count; ``ValueError``: bad width.
"""

from __future__ import annotations

import logging

import torch

from saguaro.core.stages import Stage
from saguaro.passes.base.graph_pass import EPILOGUE_SPLICED, FLAT_SIGNATURE, LOGITS_OUTPUT, GraphPass
from saguaro.passes.base.graph_splice import (
    PassError,
    add_inputs,
    inline_function,
    logits_node,
    output_node,
    replace_outputs,
)

log = logging.getLogger(__name__)

LOGITS_NODE = "saguaro_logits"  # a node's meta: it is the logits [B, T, V] the epilogue reads (last_row_head)


def check_width(stage: Stage, width: int) -> None:
    if stage.ranked and (not isinstance(width, int) or width < 1):
        raise ValueError(
            f"width={width!r} is not allowed for stage {stage.qualified}: its epilogue ranks the top "
            "tokens, so it needs an int >= 1"
        )


def splice_epilogue(gm: torch.fx.GraphModule, stage: Stage, width: int = 0) -> torch.fx.GraphModule:
    check_width(stage, width)
    logits = logits_node(gm)  # [B, T, V]
    logits.meta[LOGITS_NODE] = True
    placeholders = {n.target: n for n in gm.graph.nodes if n.op == "placeholder"}
    missing = [name for name in stage.reads if name not in placeholders]
    if missing:
        raise PassError(
            f"splice_epilogue({stage.qualified}): its epilogue reads graph inputs {', '.join(missing)}, "
            f"which the graph does not have (it has {', '.join(placeholders)})"
        )
    reads = [placeholders[name] for name in stage.reads]
    extra = add_inputs(gm, list(stage.inputs))
    constants = {"width": width} if stage.ranked else {}
    before = len(gm.graph.nodes)
    out = output_node(gm)
    results = inline_function(gm, stage.epilogue_function, [logits, *reads, *extra], out, **constants)
    results = tuple(results) if isinstance(results, (tuple, list)) else (results,)
    if len(results) != len(stage.outputs):
        raise PassError(
            f"splice_epilogue({stage.qualified}): FX node {out.name!r} would return {len(results)} "
            f"value(s) of {stage.epilogue}, but the stage table declares {len(stage.outputs)} "
            f"({', '.join(stage.outputs)})"
        )
    replace_outputs(gm, results)
    log.info(
        "splice_epilogue(%s): spliced %d nodes of %s; outputs %s",
        stage.qualified,
        len(gm.graph.nodes) - before,
        stage.epilogue,
        ", ".join(stage.outputs),
    )
    return gm


class SpliceEpilogue(GraphPass):
    """The pass for ``stage``; ``width``: the rank width of ranked epilogues."""

    name = "splice_epilogue"
    requires = frozenset({FLAT_SIGNATURE, LOGITS_OUTPUT})
    guarantees = frozenset({EPILOGUE_SPLICED})
    invalidates = frozenset({LOGITS_OUTPUT})

    def __init__(self, stage: Stage, width: int = 0):
        check_width(stage, width)
        self.stage, self.width = stage, width

    def run(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        return splice_epilogue(gm, self.stage, self.width)
