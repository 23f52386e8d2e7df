"""Pass: splice sampling into ``draft.step`` / ``draft.tree`` (and last-row selection into prefill).

Requires: a flat-signature graph whose only output is the logits ``[B, T, V]``.
Guarantees: the graph returns what the runtime needs and nothing bigger: ``last`` → last-row logits
``[B, V]``; ``step_greedy`` → tokens ``[B]``; ``step_sampled`` → tokens and ``q [B, V]``;
``tree_greedy`` → tokens ``[B, MQ]``; ``tree_sampled`` → tokens drawn from Saguaro's
``q'`` and ``q'`` itself. The spliced functions are those of :mod:`saguaro.runtime.sampling`.
"""

from __future__ import annotations

import logging

import torch

from saguaro.passes.graph_splice import add_inputs, inline_function, logits_node, output_node, replace_outputs
from saguaro.runtime import sampling

log = logging.getLogger(__name__)

EPILOGUES = {
    "last": (sampling.last_logits, []),
    "step_greedy": (sampling.step_greedy, []),
    "step_sampled": (sampling.step_sampled, ["inv_temperature", "u"]),
    "tree_greedy": (sampling.tree_greedy, []),
    "tree_sampled": (sampling.tree_sampled, ["inv_temperature", "top", "saguaro_c", "u"]),
}


def fuse_sampling(gm: torch.fx.GraphModule, epilogue: str, width: int = 64) -> torch.fx.GraphModule:
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue={epilogue!r} is not allowed: choose one of {', '.join(EPILOGUES)}")
    fn, names = EPILOGUES[epilogue]
    logits = logits_node(gm)
    extra = add_inputs(gm, names)
    constants = {"width": width} if epilogue == "tree_sampled" else {}
    before = len(gm.graph.nodes)
    outputs = inline_function(gm, fn, [logits, *extra], output_node(gm), **constants)
    replace_outputs(gm, outputs)
    log.info("fuse_sampling(%s): spliced %d nodes", epilogue, len(gm.graph.nodes) - before)
    return gm
