"""The lifecycle of a Program's SSD draft lane: which kind, started on first use, kept, stopped."""

from __future__ import annotations

import weakref

from saguaro.core.config import SaguaroConfig
from saguaro.runtime.draft_server import SpeculationServer
from saguaro.runtime.lanes import ThreadLane
from saguaro.runtime.model_runner import ModelRunner


def lane_kind(config: SaguaroConfig, device_type: str) -> str:
    """The configured lane, or for ``"auto"`` the process lane for the eager backend on CPU (the GIL,
    held while FX graphs are interpreted, makes a thread lane slow the target down) and the thread lane
    otherwise (see :class:`~saguaro.core.config.SaguaroConfig`)."""
    if config.lane != "auto":
        return config.lane
    return "process" if device_type == "cpu" and config.backend == "eager" else "thread"


class LaneOwner:
    """Owns at most one draft lane. ``remote_draft`` (picklable) rebuilds the draft side in a draft
    process; the thread lane serves the in-process ``draft`` runner."""

    def __init__(self, config: SaguaroConfig, draft: ModelRunner, remote_draft):
        self.config = config
        self.draft = draft
        self.remote_draft = remote_draft
        self.kind = lane_kind(config, draft.spec.device.type)
        self._lane = None
        self._finalizer = None

    def lane(self):
        """The lane, started on first use (raises ``DraftLaneError`` when it cannot start)."""
        if self._lane is None:
            if self.kind == "process":
                from saguaro.runtime.process_lane import ProcessLane  # torch.distributed only when used

                self._lane = ProcessLane(self.remote_draft, self.config, self.config.lane_timeout_s)
            else:
                self._lane = ThreadLane(SpeculationServer(self.draft, self.config), self.draft.spec.device,
                                        self.config.lane_timeout_s)
            self._finalizer = weakref.finalize(self, self._lane.close)
        return self._lane

    def close(self) -> None:
        """Stop the lane; the next :meth:`lane` starts a new one."""
        if self._lane is not None:
            self._finalizer()
            self._lane = None
