"""Pass: splice the fork into ``draft.glue``.

Requires: a flat-signature draft graph whose only output is the glue logits ``[B, K+1, V]``.
Guarantees: the graph also takes the speculated tokens ``[B, K]`` and the branch layout
(``branch_rows``, ``branch_ranks``, both ``[MQ]``) and returns ``candidates [B, MQ]`` (top-``F_j`` of
row ``j`` without ``x_{j+1}``) and ``ranked [B, K+1, W]``; the logits stay inside. The spliced
function is :func:`saguaro.runtime.fork.fork_with_ranks`.
"""

from __future__ import annotations

import logging

import torch

from saguaro.passes.graph_splice import add_inputs, inline_function, logits_node, output_node, replace_outputs
from saguaro.runtime.fork import fork_with_ranks

log = logging.getLogger(__name__)


def fuse_fork(gm: torch.fx.GraphModule, width: int) -> torch.fx.GraphModule:
    logits = logits_node(gm)
    extra = add_inputs(gm, ["draft_tokens", "branch_rows", "branch_ranks"])
    before = len(gm.graph.nodes)
    outputs = inline_function(gm, fork_with_ranks, [logits, *extra], output_node(gm), width=width)
    replace_outputs(gm, outputs)
    log.info("fuse_fork: spliced %d nodes; outputs candidates, ranked (width %d)", len(gm.graph.nodes) - before,
             width)
    return gm
