"""Run one captured model's stages over its KV store: each built on first use by a :class:`StageBuilder`
(the runtime never imports passes or lowering), timed in device time, callable from another device
of the process (``draft_device``: non-blocking copies in and out)."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

import torch

from saguaro.capture.export import CapturedModel
from saguaro.core.stages import Stage
from saguaro.runtime.base.kv_store import KVStore
from saguaro.runtime.base.timing import Interval, Stopwatch

log = logging.getLogger(__name__)

COST_WEIGHT = 0.1  # weight of a new call in a stage's running mean cost
MAX_PENDING = 1024  # stage timings in flight on a device before a call waits for the oldest
# a stage's first flat inputs that a query sets: input_ids, positions, write_slots, branch, limit
QUERY_ARGS = 5


def graph_modules_of(fn) -> list[torch.fx.GraphModule]:
    """The GraphModules behind a built stage, each once: itself (eager), a compiled or tiered stage's
    ``gm`` and its eager graph; none for a loaded artifact's stage."""
    found = []
    for candidate in (fn, getattr(fn, "gm", None), getattr(getattr(fn, "compiled", None), "gm", None)):
        if isinstance(candidate, torch.fx.GraphModule) and all(candidate is not m for m in found):
            found.append(candidate)
    return found


class StageBuilder(Protocol):
    """What builds one model's stages: the runtime calls it, the inspector asks it for graphs."""

    def __call__(self, stage: Stage) -> Callable:
        """The runnable ``stage``: ``fn(*flat inputs) -> tuple of outputs``."""

    def stage_graph(self, stage: Stage, observe: Callable[[str, torch.fx.GraphModule], None] | None = None):
        """``stage``'s ``torch.fx.GraphModule`` after every pass; ``observe(pass name, gm)`` sees it as
        ``"captured"`` and after each pass. ``ValueError`` from a builder that holds no captured graph."""


class ModelRunner:
    """A captured model, its lowered stages, and the bookkeeping every stage call shares."""

    def __init__(
        self, name: str, captured: CapturedModel, build: StageBuilder, width: int, kv_pool=None, seq_pool=None
    ):
        self.name = name
        self.captured = captured
        self.spec = captured.spec
        self.build = build  # Stage -> the lowered callable
        self.width = width  # fork / rank / Saguaro-sampling width
        self.kv_pool = kv_pool  # a KVPool: stores of one shape keep their addresses (CUDA graphs)
        self.seq_pool = seq_pool  # a SequencePool: the same for the sequence buffers
        self._stages: dict = {}
        self._graphed: dict = {}  # name -> the builder's graph of a function of several stages, or None
        self._lock = threading.Lock()  # two lanes may ask for stages of one model at once
        self.stage_build_s: dict = {}
        self._stage_cost_s: dict = {}  # running mean seconds per call, the schedule's node costs
        self._timings: deque = deque()  # (stage name, Interval) not folded into the means yet
        self._timings_lock = threading.Lock()  # a lane's worker and the caller may both fold
        self.recorder = None  # a runtime.trace.TraceRecorder while a traced generate runs
        self._repeats: dict = {}  # (stage, query width) -> (the store's tensors, its query call)

    def new_store(self, batch: int, capacity: int) -> KVStore:
        return RunnerStore(self.spec, batch, capacity, pool=self.kv_pool)

    @property
    def stage_cost_s(self) -> dict:
        """``{stage name: running mean device seconds per call}``; waits for the stage calls still running."""
        self._fold(wait_for_all=True)
        return self._stage_cost_s

    def _fold(self, wait_for_all: bool) -> None:
        """Fold finished stage timings into the running means, in call order (all when asked)."""
        with self._timings_lock:
            while self._timings and (wait_for_all or self._timings[0][1].ready()):
                key, interval = self._timings.popleft()
                elapsed, previous = interval.seconds, self._stage_cost_s.get(key)
                self._stage_cost_s[key] = (
                    elapsed if previous is None else ((1 - COST_WEIGHT) * previous + COST_WEIGHT * elapsed)
                )

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

    def provides(self, stage: Stage) -> bool:
        """Whether the builder offers ``stage`` (its ``provides``; every stage without one)."""
        provides = getattr(self.build, "provides", None)
        return True if provides is None else provides(stage)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for the builder's background compiles: True once none is left, False after ``timeout`` s."""
        wait = getattr(self.build, "wait_compiled", None)
        return True if wait is None else wait(timeout)

    def first_tokens_out(self) -> None:
        """Tell the builder the first round of tokens is out (a held background compiler starts)."""
        hook = getattr(self.build, "first_tokens_out", None)
        if hook is not None:
            hook()

    def stop_compiling(self) -> None:
        """Drop the builder's queued background compiles and stop its compile thread, if it has one."""
        stop = getattr(self.build, "stop_compiling", None)
        if stop is not None:
            stop()

    def compile_blocking(self) -> None:
        """Wait for the background compiles, then compile every later new stage or shape on the calling
        thread (the builder's ``compile_blocking``; each built stage's ``blocking`` switch)."""
        self.wait_compiled()
        hook = getattr(self.build, "compile_blocking", None)
        if hook is not None:
            hook()
        for fn in self.built_stages.values():
            if hasattr(fn, "blocking"):
                fn.blocking = True

    def graphed(self, name: str, fn: Callable, fixed) -> Callable | None:
        """``fn`` (a function of several stages over flat tensors, ``fixed`` the positions of those at fixed
        addresses) as CUDA graphs, made once per ``name`` by the builder's ``graphed``; None without."""
        with self._lock:
            if name not in self._graphed:
                hook = getattr(self.build, "graphed", None)
                self._graphed[name] = None if hook is None else hook(fn, name, fixed)
            return self._graphed[name]

    def graphs_off(self) -> dict:
        """``{stage name: why}`` of the built stages and :meth:`graphed` functions running without their
        CUDA graphs (a first replay that differed, a failed capture); empty without CUDA graphs."""
        built = {stage.qualified: fn for stage, fn in self.built_stages.items()} | self._graphed
        return {
            name: why for name, fn in built.items() if (why := getattr(fn, "graphs_off", None)) is not None
        }

    @property
    def built_stages(self) -> dict:
        """``{stage: lowered callable}`` of every stage built so far."""
        return dict(self._stages)

    def stage_graphs(self) -> list[tuple[Stage, torch.fx.GraphModule]]:
        """``(stage, graph module)`` of every stage built so far (:func:`graph_modules_of`)."""
        return [(stage, gm) for stage, fn in self._stages.items() for gm in graph_modules_of(fn)]

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
        note: str | None = None,  # what the call is for, named in traces after the stage
        claimed: bool = False,  # the write slots hold these tokens already (AR's round claimed them)
    ):
        """Call ``stage`` on ``store``, claiming the write slots unless ``claimed``; outputs on the caller's
        device."""
        caller, home = input_ids.device, self.spec.device
        if elsewhere(caller, home):  # a caller on another device of this process (draft_device)
            input_ids, positions, write_slots, branch, limit = (
                to_device(t, home) for t in (input_ids, positions, write_slots, branch, limit)
            )
            extra = tuple(to_device(t, home) for t in extra)
        args = self._graph_args(store, input_ids, positions, write_slots, branch, limit, claimed)
        fn = self.stage(stage)
        watch = Stopwatch(home)  # on the device's current stream: a lane's own, on a lane
        if self.recorder is None:
            out = fn(*args, *extra)
            self._timed(stage.qualified, watch.stop())
        else:  # a slice named by the stage on this model's track
            name = stage.qualified if depth is None else f"{stage.qualified} depth {depth}"
            name = name if note is None else f"{name} {note}"
            slice_args = {"rows": int(input_ids.shape[0]), "tokens": int(input_ids.shape[1])}
            with self.recorder.slice(self.name, name, slice_args):
                out = fn(*args, *extra)
            interval = watch.stop()
            self._timed(stage.qualified, interval)
            if watch.stream is not None:  # CUDA: the slice spans the launch; device time rides along
                slice_args["device_ms"] = interval  # read when the trace is taken
        if elsewhere(caller, home):
            out = tuple(to_device(t, caller) for t in out)
        return out

    def make_query_call(
        self,
        stage: Stage,
        store: KVStore,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        branch: torch.Tensor,
    ):
        """A call for later runs of ``stage`` on this store changing only the query (slots claimed):
        ``call(input_ids, positions, write_slots, branch=branch)``, None from a query of another shape (then
        :meth:`run`). Made once by the lowered stage's ``repeated``, timed as :meth:`run`, kept for
        :meth:`kept_query_call`; None where the stage has none, off CPU, tracing, or from another device."""
        make = getattr(self._stages.get(stage), "repeated", None)
        home = self.spec.device
        if (
            make is None
            or self.recorder is not None
            or home.type != "cpu"
            or elsewhere(input_ids.device, home)
        ):
            return None
        fast = make(
            self._graph_args(store, input_ids, positions, write_slots, branch, None, claimed=True), QUERY_ARGS
        )
        if fast is None:
            return None
        key = stage.qualified

        def call(
            ids: torch.Tensor,
            query_positions: torch.Tensor,
            slots: torch.Tensor,
            branch: torch.Tensor = branch,
        ):
            started = time.perf_counter()
            out = fast(ids, query_positions, slots, branch, query_positions)  # limit: its own position
            if out is not None:
                self._timed(key, Interval(time.perf_counter() - started))
            return out

        call.applies = fast.applies
        self._repeats[stage, input_ids.shape[1]] = (_store_tensors(store), call)  # one store's at a time
        return call

    def kept_query_call(self, stage: Stage, store: KVStore, width: int = 1):
        """The call :meth:`make_query_call` kept for ``stage`` and ``width``-token queries if made on this
        very store (the same tensor objects) and still applying; else None, and None while tracing."""
        kept = self._repeats.get((stage, width))
        if kept is None or self.recorder is not None:
            return None
        tensors, call = kept
        same = len(tensors) == len(now := _store_tensors(store)) and all(a is b for a, b in zip(tensors, now))
        return call if same and call.applies() else None

    def _timed(self, key: str, interval: Interval) -> None:
        with self._timings_lock:
            self._timings.append((key, interval))
        # CPU: every interval is ready. CUDA: fold the finished ones, wait for the oldest past
        # MAX_PENDING, and never while a graph is being captured (no event may be queried then)
        if self.spec.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        self._fold(wait_for_all=len(self._timings) > MAX_PENDING)

    def __call__(
        self, store: KVStore, input_ids, positions, write_slots, branch=None, limit=None
    ) -> torch.Tensor:
        """The captured graph itself: logits ``[B, T, V]`` on ``input_ids``' device (tests, recovery)."""
        caller, home = input_ids.device, self.spec.device
        inputs = tuple(to_device(t, home) for t in (input_ids, positions, write_slots, branch, limit))
        return to_device(self.captured.graph_module(*self._graph_args(store, *inputs))[0], caller)

    @staticmethod
    def _graph_args(store: KVStore, input_ids, positions, write_slots, branch, limit, claimed=False) -> tuple:
        """Claim the written slots unless ``claimed``; the flat inputs every graph of a model shares."""
        if branch is None:
            branch = torch.zeros_like(positions)  # shared
        if limit is None:
            limit = positions  # the query's own position
        if not claimed:
            store.claim(write_slots, positions, branch)
        return (
            input_ids,
            positions,
            write_slots,
            branch,
            limit,
            store.slot_pos,
            store.slot_branch,
            *store.k_caches,
            *store.v_caches,
        )


def _store_tensors(store: KVStore) -> tuple:
    return (store.slot_pos, store.slot_branch, *store.k_caches, *store.v_caches)


class RunnerStore(KVStore):
    """A :class:`KVStore` whose roll-back lengths may live on the caller's device."""

    def invalidate_from(self, lengths: torch.Tensor) -> None:
        super().invalidate_from(to_device(lengths, self.slot_pos.device))


def to_device(value, device: torch.device):
    """``value`` on ``device`` (a non-blocking copy) when it is a tensor elsewhere; anything else as is."""
    if isinstance(value, torch.Tensor) and elsewhere(value.device, device):
        return value.to(device, non_blocking=True)
    return value


def elsewhere(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` are different devices (an index-less ``cuda`` matches any index)."""
    return a.type != b.type or (a.index is not None and b.index is not None and a.index != b.index)
