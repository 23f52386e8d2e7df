"""Pass: splice a stage's epilogue after the logits, so the stage returns small tensors.

One pass for every stage, parameterised by the stage table (:mod:`saguaro.core.stages`): the stage
names its epilogue (a :mod:`saguaro.tensor_math` function of the logits), the extra inputs it takes
and the outputs it returns.

Requires: a flat-signature graph (inputs are appended after the existing ones) whose only output is
the logits ``[B, T, V]``.
Guarantees: the graph also takes ``stage.inputs`` (after its own) and returns ``stage.outputs``, the
epilogue's results over ``(logits, *reads, *inputs)`` (``stage.reads``: inputs of the graph itself; the rank
width ``W`` baked in for ranked epilogues);
the logits stay inside. By stage: ``prefill``/``step`` → last-row logits ``[B, V]``;
``target.verify_*`` → ``accepted [B]``, ``next_token [B]``; ``draft.step_greedy`` → tokens ``[B]``;
``draft.step_sampled`` → tokens and ``q [B, V]``; ``draft.glue`` → ``candidates [B, MQ]`` (top-``F_j``
of row ``j`` without ``x_{j+1}``) and ``ranked [B, K+1, W]``; ``draft.tree_greedy`` → tokens
``[B, MQ]``; ``draft.tree_sampled`` → tokens drawn from Saguaro's ``q'`` and ``q' [B, MQ, V]``;
``target.round_greedy`` → the next round's query ``[B, 1]`` x 3, the new lengths and finished ``[B]`` and
the active rows ``[]``, its token written into the token buffer and the next slot claimed in the store, in
place; ``target.verify_round_greedy`` → the outcome ``[4, B]``, the new lengths and finished ``[B]``, the
next round's draft inputs ``[B, 2]`` x 3 and verify slots and positions ``[B, K+1]`` x 2, its decided tokens
written into the token buffer.
Contract (:mod:`~saguaro.passes.base.graph_pass`): requires ``flat_signature`` and ``logits_output``,
which it invalidates; guarantees ``epilogue_spliced``.
"""

from __future__ import annotations

import logging

import torch

from saguaro.core.stages import Stage
from saguaro.passes.base.graph_pass import EPILOGUE_SPLICED, FLAT_SIGNATURE, LOGITS_OUTPUT, GraphPass
from saguaro.passes.base.graph_splice import (
    PassError, add_inputs, inline_function, logits_node, output_node, replace_outputs,
)

log = logging.getLogger(__name__)

LOGITS_NODE = "saguaro_logits"  # a node's meta: it is the logits [B, T, V] the epilogue reads (last_row_head)


def check_width(stage: Stage, width: int) -> None:
    if stage.ranked and (not isinstance(width, int) or width < 1):
        raise ValueError(f"width={width!r} is not allowed for stage {stage.qualified}: its epilogue ranks the top "
                         "tokens, so it needs an int >= 1")


def splice_epilogue(gm: torch.fx.GraphModule, stage: Stage, width: int = 0) -> torch.fx.GraphModule:
    check_width(stage, width)
    logits = logits_node(gm)  # [B, T, V]
    logits.meta[LOGITS_NODE] = True
    placeholders = {n.target: n for n in gm.graph.nodes if n.op == "placeholder"}
    missing = [name for name in stage.reads if name not in placeholders]
    if missing:
        raise PassError(f"splice_epilogue({stage.qualified}): its epilogue reads graph inputs {', '.join(missing)}, "
                        f"which the graph does not have (it has {', '.join(placeholders)})")
    reads = [placeholders[name] for name in stage.reads]
    extra = add_inputs(gm, list(stage.inputs))
    constants = {"width": width} if stage.ranked else {}
    before = len(gm.graph.nodes)
    out = output_node(gm)
    results = inline_function(gm, stage.epilogue_function, [logits, *reads, *extra], out, **constants)
    results = tuple(results) if isinstance(results, (tuple, list)) else (results,)
    if len(results) != len(stage.outputs):
        raise PassError(f"splice_epilogue({stage.qualified}): FX node {out.name!r} would return {len(results)} "
                        f"value(s) of {stage.epilogue}, but the stage table declares {len(stage.outputs)} "
                        f"({', '.join(stage.outputs)})")
    replace_outputs(gm, results)
    log.info("splice_epilogue(%s): spliced %d nodes of %s; outputs %s", stage.qualified,
             len(gm.graph.nodes) - before, stage.epilogue, ", ".join(stage.outputs))
    return gm


class SpliceEpilogue(GraphPass):
    """The pass for ``stage``; ``width`` is the rank width of ranked epilogues (ignored by the others)."""

    name = "splice_epilogue"
    requires = frozenset({FLAT_SIGNATURE, LOGITS_OUTPUT})
    guarantees = frozenset({EPILOGUE_SPLICED})
    invalidates = frozenset({LOGITS_OUTPUT})

    def __init__(self, stage: Stage, width: int = 0):
        check_width(stage, width)
        self.stage, self.width = stage, width

    def run(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        return splice_epilogue(gm, self.stage, self.width)
