"""Pass: splice verification into ``target.verify``.

Requires: a flat-signature target graph whose only output is the logits ``[B, K+1, V]``, and one of
the ``target.verify`` stages of :mod:`saguaro.core.stages`.
Guarantees: the graph takes the speculation's draft tokens (and, sampled, their proposal
distributions, ``1/T`` and the uniforms) and returns ``accepted [B]`` and ``next_token [B]``; no
``[B, K+1, V]`` logits leave it. The spliced function is the stage's epilogue,
:func:`saguaro.tensor_math.verification.verify_greedy` / ``verify_sampled``.
"""

from __future__ import annotations

import logging

import torch

from saguaro.core.stages import Stage
from saguaro.passes.graph_splice import check_epilogue_pass, splice_epilogue

log = logging.getLogger(__name__)


def fuse_verification(gm: torch.fx.GraphModule, stage: Stage, width: int = 0) -> torch.fx.GraphModule:
    check_epilogue_pass(stage, "fuse_verification")
    added = splice_epilogue(gm, stage, width)
    log.info("fuse_verification(%s): spliced %d nodes; outputs accepted, next_token", stage.qualified, added)
    return gm
