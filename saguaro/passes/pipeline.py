"""The ordered pass pipeline every captured graph goes through before lowering."""

from __future__ import annotations

import torch

from saguaro.passes.strip_runtime_checks import strip_runtime_checks

# Order matters: later passes match on the cleaned graph, so cleanup runs first.
PIPELINE = (
    strip_runtime_checks,  # first: removes nodes that would otherwise sit between pattern nodes
)


def run_pipeline(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Apply every pass of :data:`PIPELINE` in order."""
    for graph_pass in PIPELINE:
        gm = graph_pass(gm)
    return gm
