"""Lowering: a stage GraphModule → a callable on a backend (eager or inductor)."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

BACKENDS = ("eager", "inductor")


def lower_graph(gm: torch.fx.GraphModule, backend: str, name: str):
    """``eager`` runs the GraphModule itself; ``inductor`` compiles it with ``torch.compile``
    (``fullgraph=True``: a graph break is an error). A stage compiles for the static shapes of its
    first call; a second shape of the same stage (another prompt length, batch or KV capacity)
    recompiles it once with those dimensions dynamic (dynamo's automatic dynamic shapes). Inductor's
    FX graph cache (on by default) serves repeated compiles of the same graph."""
    if backend == "eager":
        return gm
    if backend == "inductor":
        log.info("lowering %s with inductor (compiled on its first call per shape)", name)
        # compile the generated forward itself: GraphModule.__call__'s error wrapper walks tracebacks
        # with a generator, which hides the real error of a failed compile under "trace generator"
        return torch.compile(gm.forward, backend="inductor", fullgraph=True)
    raise ValueError(f"backend={backend!r} is not allowed: choose one of {', '.join(BACKENDS)}")
