"""The ordered pass pipelines: the base pipeline every captured graph goes through once, and the
stage pipeline that derives each stage's graph (of :mod:`saguaro.core.stages`) from it."""

from __future__ import annotations

import copy
import logging
from typing import Callable

import torch
from torch._logging import trace_structured

from saguaro.capture.attention_op import MASK_OP
from saguaro.core.stages import Stage
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

EPILOGUE_PASSES = {graph_pass.__name__: graph_pass for graph_pass in (fuse_verification, fuse_fork, fuse_sampling)}


def run_pipeline(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Apply every pass of :data:`PIPELINE` in order."""
    for graph_pass in PIPELINE:
        gm = graph_pass(gm)
    return gm


def stage_passes(stage: Stage, width: int, attention: str, window: int) -> list[tuple[str, Callable]]:
    """The stage pipeline of ``stage``, in order, as ``(pass name, GraphModule -> GraphModule)``.

    Order matters: the mask is specialised before the epilogue is spliced (the epilogue pass must see
    the final logits node as the only output), and attention is lowered last, so that it sees the
    final graph, whose attention nodes all read one mask.
    """
    epilogue = EPILOGUE_PASSES[stage.epilogue_pass]
    return [
        ("specialize_attention", lambda gm: specialize_attention(gm, stage.mask)),
        (stage.epilogue_pass, lambda gm: epilogue(gm, stage, width)),
        ("lower_attention", lambda gm: lower_attention(gm, attention, window=window)),
    ]


def build_stage(base: torch.fx.GraphModule, stage: Stage, width: int, attention: str = "op",
                observe: Callable[[str, torch.fx.GraphModule], None] | None = None) -> torch.fx.GraphModule:
    """The graph of ``stage``: a copy of the base graph (sharing its parameters) through the stage
    pipeline. ``attention`` is how ``lower_attention`` lowers attention (``"op"``, ``"inline"`` or
    ``"flex"``). ``observe(pass_name, gm)``, when given, sees the graph before the first pass (name
    ``"captured"``) and after each pass."""
    gm = torch.fx.GraphModule(base, copy.deepcopy(base.graph))  # shares parameters, owns its graph
    if observe is not None:
        observe("captured", gm)
    for name, graph_pass in stage_passes(stage, width, attention, _sliding_window(base)):
        gm = graph_pass(gm)
        if observe is not None:
            observe(name, gm)
    log.info("stage %s: %d nodes", stage.qualified, len(gm.graph.nodes))
    # the stage graph beside Inductor's own artifacts in TORCH_TRACE (tlparse); free without a handler
    trace_structured("artifact", metadata_fn=lambda: {"name": f"saguaro_stage_{stage.qualified}",
                                                      "encoding": "string"},
                     payload_fn=lambda: gm.print_readable(print_output=False, include_stride=True,
                                                          include_device=True), expect_trace_id=False)
    return gm


def _sliding_window(base: torch.fx.GraphModule) -> int:
    """The window the captured model's generic mask node was built with (0: none)."""
    node = next((n for n in base.graph.nodes if n.op == "call_function" and n.target is MASK_OP), None)
    return int(node.args[6]) if node is not None else 0
