"""The draft lane as a type: :class:`DraftLane` (where a draft server runs) and :class:`DraftClient`
(the typed calls on one). A lane runs server methods in the order sent, ``post`` returning at once and
``call`` waiting; methods travel as :class:`Method` members, checked at import (:func:`check_methods`)."""

from __future__ import annotations

import enum
from contextlib import contextmanager
from typing import Any, Protocol, runtime_checkable

import torch

from saguaro.core.errors import SaguaroError
from saguaro.runtime.draft.server import GenerateSpec, Lookup, Speculation, SpeculationServer


class DraftLaneError(SaguaroError):
    """The draft lane failed: an exception, a dead process, or no answer within the timeout."""


class Method(enum.Enum):
    """The server methods a lane may run; the value is the method's name on the server."""

    OPEN = "open"
    START = "start"
    BUILD = "build"
    MATCH = "match"
    FALLBACK = "fallback"
    WARM_UP = "warm_up"
    BUILD_BUDGET = "build_budget"
    FINISHED = "finished"
    TRACE_START = "trace_start"
    TRACE_TAKE = "trace_take"
    PLAN_COSTS = "plan_costs"
    JOIN_ROWS = "join_rows"  # continuous batching (runtime/draft/rows.py)
    KEEP_ROWS = "keep_rows"  # last: a method's index is its number on the remote lane's wire; add after it

    def bound_to(self, server: SpeculationServer):
        """The server's bound method."""
        return getattr(server, self.value)


def check_methods(server_class: type = SpeculationServer) -> None:
    """``TypeError`` unless every :class:`Method` is a callable of ``server_class``."""
    missing = [m.value for m in Method if not callable(getattr(server_class, m.value, None))]
    if missing:
        raise TypeError(f"{server_class.__name__} lacks the lane methods {missing}")


check_methods()


@runtime_checkable
class DraftLane(Protocol):
    """Where a draft server runs; ``kind`` names it (``stats["lane"]``), ``recorder`` is a trace recorder
    while a traced generation runs (transport slices), else None."""

    kind: str
    recorder: Any

    def post(self, method: Method, *args) -> None:
        """Start ``method(*args)`` on the server and return at once."""

    def call(self, method: Method, *args, timeout_s: float | None = None):
        """Wait for what was posted, run ``method(*args)``, return its result; ``DraftLaneError`` on a failure
        or no answer within ``timeout_s`` (default: the lane's)."""

    def settle(self) -> None:
        """Wait for posted work that must end before ``generate`` returns (a lane in this process)."""

    def take_trace(self) -> list[dict]:
        """The server side's trace events of a traced generation; recording stops."""

    def close(self) -> None:
        """Stop the lane; nothing is left running."""


class DraftClient:
    """The typed calls on a lane's speculation server (each as :class:`SpeculationServer` documents it)."""

    def __init__(self, lane: DraftLane):
        self.lane = lane
        # the BatchSession whose rows the server holds between its rounds; None once a generation (or a
        # warm-up) has opened the server for itself: that session's rows are gone from it
        self.holder = None

    @property
    def kind(self) -> str:
        return self.lane.kind

    @property
    def recorder(self):
        """The lane's trace recorder (set while a traced generation runs)."""
        return self.lane.recorder

    @recorder.setter
    def recorder(self, recorder) -> None:
        self.lane.recorder = recorder

    def open(self, spec: GenerateSpec) -> None:
        self.holder = None
        self.lane.call(Method.OPEN, spec)

    def start(self, first_tokens: torch.Tensor) -> Speculation:
        return self.lane.call(Method.START, first_tokens)

    def build(self) -> None:
        """Posted: glue, fork and tree decode run while the caller verifies."""
        self.lane.post(Method.BUILD)

    def match(self, accepted: list, outcome: list, verify_s: float) -> Lookup:
        """The outcome as host lists from the round's one read (``accepted[b]`` None for a finished row)."""
        return self.lane.call(Method.MATCH, accepted, outcome, verify_s)

    def fallback(self, missed: list) -> Speculation:
        """``missed[b]``: whether row ``b`` needs a fallback speculation."""
        return self.lane.call(Method.FALLBACK, missed)

    def warm_up(self, spec: GenerateSpec, first_tokens: torch.Tensor, timeout_s: float):
        """Every stage shape of a generation like ``spec`` run once; the stage costs, or None."""
        self.holder = None
        return self.lane.call(Method.WARM_UP, spec, first_tokens, timeout_s=timeout_s)

    def join_rows(self, spec: GenerateSpec, first_tokens: torch.Tensor) -> Speculation:
        """Between rounds: one row (``spec`` of batch 1, first token ``[1]``) joins as the last; its first
        speculation ``[1, K]``."""
        return self.lane.call(Method.JOIN_ROWS, spec, first_tokens)

    def keep_rows(self, rows: list) -> None:
        """Between rounds: only ``rows`` (increasing host ints) stay, in that order."""
        self.lane.call(Method.KEEP_ROWS, list(rows))

    def build_budget(self, budget: int | None) -> None:
        """Posted: a build with the planner's fan-out for ``budget`` branches (calibration)."""
        self.lane.post(Method.BUILD_BUDGET, budget)

    def plan_costs(self):
        """Waits for what was posted; the costs the builds measured since ``warm_up`` (against the verify)."""
        return self.lane.call(Method.PLAN_COSTS)

    def finished(self) -> bool:
        """Waits for what was posted; True once every row of the server's generation has finished."""
        return self.lane.call(Method.FINISHED)

    def trace_start(self) -> None:
        """Posted: the server records trace events."""
        self.lane.post(Method.TRACE_START)

    def take_trace(self) -> list[dict]:
        return self.lane.take_trace()

    def settle(self) -> None:
        self.lane.settle()


@contextmanager
def one_thread_per_lane(device: torch.device):
    """One intra-op thread for the caller's lane on CPU; the setting is restored afterwards."""
    if device.type != "cpu":
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
