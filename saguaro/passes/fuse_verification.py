"""Pass: splice verification into ``target.verify``.

Requires: a flat-signature target graph whose only output is the logits ``[B, K+1, V]``.
Guarantees: the graph takes the speculation's draft tokens (and, sampled, their proposal
distributions, ``1/T`` and the uniforms) and returns ``accepted [B]`` and ``next_token [B]``; no
``[B, K+1, V]`` logits leave it. The spliced function is the runtime's own
:func:`saguaro.runtime.verification.verify_greedy` / ``verify_sampled``.
"""

from __future__ import annotations

import logging

import torch

from saguaro.passes.graph_splice import add_inputs, inline_function, logits_node, output_node, replace_outputs
from saguaro.runtime import verification

log = logging.getLogger(__name__)

SAMPLED_INPUTS = ["draft_tokens", "draft_probs", "inv_temperature", "accept_u", "resample_u"]


def fuse_verification(gm: torch.fx.GraphModule, sampled: bool) -> torch.fx.GraphModule:
    logits = logits_node(gm)
    names = SAMPLED_INPUTS if sampled else SAMPLED_INPUTS[:1]
    extra = add_inputs(gm, names)
    fn = verification.verify_sampled if sampled else verification.verify_greedy
    before = len(gm.graph.nodes)
    outputs = inline_function(gm, fn, [logits, *extra], output_node(gm))
    replace_outputs(gm, outputs)
    log.info("fuse_verification(%s): spliced %d nodes; outputs accepted, next_token",
             "sampled" if sampled else "greedy", len(gm.graph.nodes) - before)
    return gm
