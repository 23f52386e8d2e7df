"""Run one captured model's stages over its KV store.

Each stage graph (``prefill``, ``verify_greedy``, ``glue``, ``tree_sampled``, ...) is derived from
the captured graph by the stage pipeline and lowered on first use, so a program only builds (and,
with inductor, compiles) the stages its modes call.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from saguaro.capture.export import CapturedModel
from saguaro.runtime.fork import RANK_WIDTH
from saguaro.runtime.kv_store import KVStore

log = logging.getLogger(__name__)


class ModelRunner:
    """A captured model, its lowered stages, and the bookkeeping every stage call shares."""

    def __init__(self, name: str, captured: CapturedModel, backend: str, attention: str = "auto"):
        self.name = name
        self.captured = captured
        self.spec = captured.spec
        self.backend = backend
        self.attention = attention  # the config's choice; "auto" resolves per backend
        self.width = min(self.spec.vocab_size, RANK_WIDTH)  # fork / rank / Saguaro-sampling width
        self._stages: dict = {}
        self._lock = threading.Lock()  # two lanes may ask for stages of one model at once
        self.stage_build_s: dict = {}
        self.stage_cost_s: dict = {}  # running mean seconds per call, the schedule's node costs

    def new_store(self, batch: int, capacity: int) -> KVStore:
        return KVStore(self.spec, batch, capacity)

    def stage(self, stage: str):
        """The lowered callable of ``stage``, built on first use."""
        fn = self._stages.get(stage)
        if fn is None:
            with self._lock:
                fn = self._stages.get(stage)
                if fn is None:
                    from saguaro.lower import attention_implementation, lower_graph
                    from saguaro.passes.pipeline import build_stage

                    started = time.perf_counter()
                    graph = build_stage(self.captured.graph_module, stage, self.width,
                                        attention=attention_implementation(self.backend, self.attention))
                    fn = lower_graph(graph, self.backend, f"{self.name}.{stage}", self.spec.device.type)
                    self._stages[stage] = fn
                    self.stage_build_s[stage] = time.perf_counter() - started
        return fn

    def run(
        self,
        stage: str,
        store: KVStore,
        input_ids: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T]
        write_slots: torch.Tensor,  # [B, T]
        *extra,
        branch: torch.Tensor | None = None,  # [B, T]; None: shared (0)
        limit: torch.Tensor | None = None,  # [B, T]; None: the query's own position
    ):
        """Call ``stage`` on the store; returns the stage's outputs (a tuple)."""
        args = self._graph_args(store, input_ids, positions, write_slots, branch, limit)
        fn = self.stage(stage)
        started = time.perf_counter()
        out = fn(*args, *extra)
        elapsed = time.perf_counter() - started
        key = f"{self.name}.{stage}"
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
