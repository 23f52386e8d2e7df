"""Lowering: a stage GraphModule → a callable on a backend (eager or inductor)."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

BACKENDS = ("eager", "inductor")


def lower_graph(gm: torch.fx.GraphModule, backend: str, name: str):
    """``eager`` runs the GraphModule itself; ``inductor`` compiles it with ``torch.compile``
    (``fullgraph=True``: a graph break is an error), once per static shape."""
    if backend == "eager":
        return gm
    if backend == "inductor":
        log.info("lowering %s with inductor (compiled on its first call per shape)", name)
        return torch.compile(gm, backend="inductor", fullgraph=True, dynamic=False)
    raise ValueError(f"backend={backend!r} is not allowed: choose one of {', '.join(BACKENDS)}")
