"""Run one captured model's stages over its KV store.

Each stage (:mod:`saguaro.core.stages`) is built on its first use by the runner's
:class:`StageBuilder` (``saguaro.compile``'s: the stage pass pipeline, then lowering; the exporter's
recorder; a loaded artifact's), so a program only builds (and, with inductor, compiles) the stages its
modes call. The runtime never imports the passes or the lowering.
"""

from __future__ import annotations

import logging
import threading
import time

from typing import Callable, Protocol

import torch

from saguaro.capture.export import CapturedModel
from saguaro.core.stages import Stage
from saguaro.runtime.base.kv_store import KVStore

log = logging.getLogger(__name__)


class StageBuilder(Protocol):
    """What builds one model's stages: the runtime calls it, the inspector asks it for graphs."""

    def __call__(self, stage: Stage) -> Callable:
        """The runnable ``stage``: ``fn(*flat inputs) -> tuple of outputs``."""

    def stage_graph(self, stage: Stage, observe: Callable[[str, torch.fx.GraphModule], None] | None = None):
        """``stage``'s ``torch.fx.GraphModule`` after every pass. ``observe(pass name, gm)``, when given,
        sees the graph before the first pass (``"captured"``) and after each pass; a builder that holds
        no captured graph (a loaded artifact's) raises a ``ValueError`` saying what it can show."""


class ModelRunner:
    """A captured model, its lowered stages, and the bookkeeping every stage call shares."""

    def __init__(self, name: str, captured: CapturedModel, build: StageBuilder, width: int):
        self.name = name
        self.captured = captured
        self.spec = captured.spec
        self.build = build  # Stage -> the lowered callable
        self.width = width  # fork / rank / Saguaro-sampling width
        self._stages: dict = {}
        self._lock = threading.Lock()  # two lanes may ask for stages of one model at once
        self.stage_build_s: dict = {}
        self.stage_cost_s: dict = {}  # running mean seconds per call, the schedule's node costs
        self.recorder = None  # a runtime.trace.TraceRecorder while a traced generate runs

    def new_store(self, batch: int, capacity: int) -> KVStore:
        return KVStore(self.spec, batch, capacity)

    def stage(self, stage: Stage):
        """The lowered callable of ``stage``, built on first use."""
        fn = self._stages.get(stage)
        if fn is None:
            with self._lock:
                fn = self._stages.get(stage)
                if fn is None:
                    started = time.perf_counter()
                    fn = self.build(stage)
                    self._stages[stage] = fn
                    self.stage_build_s[stage.qualified] = time.perf_counter() - started
        return fn

    @property
    def built_stages(self) -> dict:
        """``{stage: lowered callable}`` of every stage built so far."""
        return dict(self._stages)

    def run(
        self,
        stage: Stage,
        store: KVStore,
        input_ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T]
        write_slots: torch.Tensor,  # [B, T]
        *extra,
        branch: torch.Tensor | None = None,  # [B, T]; None: shared (0)
        limit: torch.Tensor | None = None,  # [B, T]; None: the query's own position
        depth: int | None = None,  # tree depth, named in traces
    ):
        """Call ``stage`` on the store; returns the stage's outputs (a tuple)."""
        args = self._graph_args(store, input_ids, positions, write_slots, branch, limit)
        fn = self.stage(stage)
        started = time.perf_counter()
        if self.recorder is None:
            out = fn(*args, *extra)
        else:  # a slice named by the stage on this model's track
            name = stage.qualified if depth is None else f"{stage.qualified} depth {depth}"
            with self.recorder.slice(self.name, name, {"rows": int(input_ids.shape[0]),
                                                       "tokens": int(input_ids.shape[1])}):
                out = fn(*args, *extra)
        elapsed = time.perf_counter() - started
        key = stage.qualified
        previous = self.stage_cost_s.get(key)
        self.stage_cost_s[key] = elapsed if previous is None else 0.9 * previous + 0.1 * elapsed
        return out

    def __call__(self, store: KVStore, input_ids, positions, write_slots, branch=None, limit=None) -> torch.Tensor:
        """The captured graph itself: logits ``[B, T, V]`` (tests and recovery use it)."""
        return self.captured.graph_module(*self._graph_args(store, input_ids, positions, write_slots, branch,
                                                            limit))[0]

    @staticmethod
    def _graph_args(store: KVStore, input_ids, positions, write_slots, branch, limit) -> tuple:
        """Claim the written slots and return the flat inputs every graph of a model shares."""
        if branch is None:
            branch = torch.zeros_like(positions)  # shared
        if limit is None:
            limit = positions  # the query's own position
        store.claim(write_slots, positions, branch)
        return (input_ids, positions, write_slots, branch, limit, store.slot_pos, store.slot_branch,
                *store.k_caches, *store.v_caches)
