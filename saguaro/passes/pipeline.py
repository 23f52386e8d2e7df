"""The ordered pass pipelines: the base pipeline every captured graph goes through once, and the
stage pipeline that derives each stage's graph from it."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch

from saguaro.capture.attention_op import MASK_OP
from saguaro.passes.flatten_signature import flatten_signature
from saguaro.passes.fuse_fork import fuse_fork
from saguaro.passes.fuse_sampling import fuse_sampling
from saguaro.passes.fuse_verification import fuse_verification
from saguaro.passes.lower_attention import lower_attention
from saguaro.passes.specialize_attention import specialize_attention
from saguaro.passes.strip_runtime_checks import strip_runtime_checks

log = logging.getLogger(__name__)

# Order matters: cleanup first (it removes nodes that would sit between pattern nodes), then a flat
# signature (the stage passes append inputs and outputs).
PIPELINE = (
    strip_runtime_checks,
    flatten_signature,
)


def run_pipeline(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Apply every pass of :data:`PIPELINE` in order."""
    for graph_pass in PIPELINE:
        gm = graph_pass(gm)
    return gm


@dataclass(frozen=True)
class StageSpec:
    """One stage: its mask kind and the epilogue spliced after the logits."""

    name: str
    mask: str  # "causal" | "tree"
    epilogue: str  # "last", "step_greedy", ..., "verify_greedy", "verify_sampled", "fork"
    extra_inputs: tuple = ()


STAGES = {
    spec.name: spec for spec in (
        StageSpec("prefill", "causal", "last"),
        StageSpec("step", "causal", "last"),
        StageSpec("verify_greedy", "causal", "verify_greedy", ("draft_tokens",)),
        StageSpec("verify_sampled", "causal", "verify_sampled",
                  ("draft_tokens", "draft_probs", "inv_temperature", "accept_u", "resample_u")),
        StageSpec("step_greedy", "causal", "step_greedy"),
        StageSpec("step_sampled", "causal", "step_sampled", ("inv_temperature", "u")),
        StageSpec("glue", "causal", "fork", ("draft_tokens", "branch_rows", "branch_ranks")),
        StageSpec("tree_greedy", "tree", "tree_greedy"),
        StageSpec("tree_sampled", "tree", "tree_sampled", ("inv_temperature", "top", "saguaro_c", "u")),
    )
}


def build_stage(base: torch.fx.GraphModule, stage: str, width: int, attention: str = "op") -> torch.fx.GraphModule:
    """The stage's graph: a copy of the base graph, attention specialised (before the epilogue, which
    must see the final logits node), then its epilogue spliced, then the attention nodes lowered for
    the backend (``attention``: ``"op"``, ``"inline"`` or ``"flex"``; last, so that it sees the final
    graph, whose attention nodes all read one mask)."""
    spec = STAGES[stage]
    gm = torch.fx.GraphModule(base, copy.deepcopy(base.graph))  # shares parameters, owns its graph
    gm = specialize_attention(gm, spec.mask)
    if spec.epilogue.startswith("verify_"):
        gm = fuse_verification(gm, sampled=spec.epilogue == "verify_sampled")
    elif spec.epilogue == "fork":
        gm = fuse_fork(gm, width)
    else:
        gm = fuse_sampling(gm, spec.epilogue, width)
    gm = lower_attention(gm, attention, window=_sliding_window(base))
    log.info("stage %s: %d nodes", stage, len(gm.graph.nodes))
    return gm


def _sliding_window(base: torch.fx.GraphModule) -> int:
    """The window the captured model's generic mask node was built with (0: none)."""
    node = next((n for n in base.graph.nodes if n.op == "call_function" and n.target is MASK_OP), None)
    return int(node.args[6]) if node is not None else 0
