"""Pass: splice the fork into ``draft.glue``.

Requires: a flat-signature draft graph whose only output is the glue logits ``[B, K+1, V]``, and the
``draft.glue`` stage of :mod:`saguaro.core.stages`.
Guarantees: the graph also takes the speculated tokens ``[B, K]`` and the branch layout
(``branch_rows``, ``branch_ranks``, both ``[MQ]``) and returns ``candidates [B, MQ]`` (top-``F_j`` of
row ``j`` without ``x_{j+1}``) and ``ranked [B, K+1, W]``; the logits stay inside. The spliced
function is :func:`saguaro.tensor_math.fork.fork_with_ranks`.
"""

from __future__ import annotations

import logging

import torch

from saguaro.core.stages import Stage
from saguaro.passes.graph_splice import check_epilogue_pass, splice_epilogue

log = logging.getLogger(__name__)


def fuse_fork(gm: torch.fx.GraphModule, stage: Stage, width: int) -> torch.fx.GraphModule:
    check_epilogue_pass(stage, "fuse_fork")
    added = splice_epilogue(gm, stage, width)
    log.info("fuse_fork: spliced %d nodes; outputs candidates, ranked (width %d)", added, width)
    return gm
