"""Lowering: a captured GraphModule → a callable on a backend (eager or inductor)."""

from __future__ import annotations

import logging

import torch

from saguaro.capture.export import CapturedModel

log = logging.getLogger(__name__)


def lower_model(captured: CapturedModel, backend: str, name: str):
    """``eager`` runs the GraphModule itself; ``inductor`` wraps it in ``torch.compile(fullgraph=True)``."""
    gm = captured.graph_module
    if backend == "eager":
        return gm
    if backend == "inductor":
        log.info("lowering %s with inductor (compiled on first call per shape)", name)
        return torch.compile(gm, backend="inductor", fullgraph=True, dynamic=False)
    raise ValueError(f"backend={backend!r} is not allowed: choose 'eager' or 'inductor'")
