"""The lifecycle of a Program's SSD draft lane: which kind, started on first use, kept, stopped.

A lane that cannot start is remembered, with one warning, for the owner's life (until ``close()``):
a process lane that cannot start gives way to the thread lane; a thread lane that cannot start
leaves SD (the same tokens). An interrupt during start-up is not a failure: the next call tries again.
"""

from __future__ import annotations

import weakref

from saguaro.core.config import SaguaroConfig
from saguaro.core.warnings_at_caller import warn_at_caller
from saguaro.runtime.draft_server import SpeculationServer
from saguaro.runtime.lanes import DraftLaneError, ThreadLane
from saguaro.runtime.model_runner import ModelRunner


def lane_kind(config: SaguaroConfig, device_type: str) -> str:
    """The configured lane, or for ``"auto"`` the process lane for the eager backend on CPU (the GIL,
    held while FX graphs are interpreted, makes a thread lane slow the target down) and the thread lane
    otherwise (see :class:`~saguaro.core.config.SaguaroConfig`)."""
    if config.lane != "auto":
        return config.lane
    return "process" if device_type == "cpu" and config.backend == "eager" else "thread"


class LaneOwner:
    """Owns at most one draft lane. ``remote_draft`` rebuilds the draft side in a draft process; the
    thread lane serves the in-process ``draft`` runner."""

    def __init__(self, config: SaguaroConfig, draft: ModelRunner, remote_draft):
        self.config = config
        self.draft = draft
        self.remote_draft = remote_draft
        self.configured_kind = lane_kind(config, draft.spec.device.type)
        self.kind = self.configured_kind
        self.failure: DraftLaneError | None = None  # why no lane can start (remembered until close)
        self._lane = None
        self._finalizer = None

    def lane(self):
        """The lane, started on first use; None when no lane can start (SSD then runs as SD)."""
        if self._lane is None and self.failure is None:
            try:
                self._lane = self._start(self.kind)
            except DraftLaneError as exc:
                if self.kind != "process":
                    self.failure = exc
                    warn_at_caller(f"saguaro: {exc}; generating with SD instead (output stays exact)")
                    return None
                warn_at_caller(f"saguaro: the process lane cannot start: {exc}; SSD uses the thread lane "
                               "instead until close()")
                self.kind = "thread"
                return self.lane()
            self._finalizer = weakref.finalize(self, self._lane.close)
        return self._lane

    def _start(self, kind: str):
        if kind == "process":
            from saguaro.runtime.process_lane import ProcessLane  # subprocess machinery only when used

            return ProcessLane(self.remote_draft, self.config, self.config.lane_start_timeout_s,
                               self.config.lane_timeout_s)
        return ThreadLane(SpeculationServer(self.draft, self.config), self.draft.spec.device,
                          self.config.lane_timeout_s)

    def drop(self) -> None:
        """Stop a lane that failed mid-generation; the next :meth:`lane` starts a new one."""
        if self._lane is not None:
            self._finalizer()
            self._lane = None

    def close(self) -> None:
        """Stop the lane and forget any start-up failure: the next :meth:`lane` starts the configured kind."""
        self.drop()
        self.failure = None
        self.kind = self.configured_kind
