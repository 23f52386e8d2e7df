"""Pass: splice sampling into ``draft.step`` / ``draft.tree`` (and last-row selection into prefill).

Requires: a flat-signature graph whose only output is the logits ``[B, T, V]``, and a stage of
:mod:`saguaro.core.stages` whose epilogue pass is this one.
Guarantees: the graph returns what the runtime needs and nothing bigger: ``prefill``/``step`` →
last-row logits ``[B, V]``; ``draft.step_greedy`` → tokens ``[B]``; ``draft.step_sampled`` → tokens
and ``q [B, V]``; ``draft.tree_greedy`` → tokens ``[B, MQ]``; ``draft.tree_sampled`` → tokens drawn
from Saguaro's ``q'`` and ``q'`` itself. The spliced functions are those of
:mod:`saguaro.tensor_math.sampling`.
"""

from __future__ import annotations

import logging

import torch

from saguaro.core.stages import Stage
from saguaro.passes.graph_splice import check_epilogue_pass, splice_epilogue

log = logging.getLogger(__name__)


def fuse_sampling(gm: torch.fx.GraphModule, stage: Stage, width: int = 64) -> torch.fx.GraphModule:
    check_epilogue_pass(stage, "fuse_sampling")
    added = splice_epilogue(gm, stage, width)
    log.info("fuse_sampling(%s): spliced %d nodes", stage.qualified, added)
    return gm
