"""The lifecycle of a Program's SSD draft lane: which kind, started on first use, kept, stopped.

Kinds are registered in :data:`LANES`, each naming the kind that stands in when it cannot start (None:
SD, the same tokens). A start failure warns once and is remembered until ``close()`` (for a
``retry_each_call`` kind, until the next ``generate``); an interrupt during start-up is not one."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from saguaro.core.config import SaguaroConfig
from saguaro.core.warnings_at_caller import warn_at_caller
from saguaro.runtime.base.model_runner import ModelRunner
from saguaro.runtime.draft.server import SpeculationServer
from saguaro.runtime.lanes.protocol import DraftClient, DraftLane, DraftLaneError, one_thread_per_lane
from saguaro.runtime.lanes.streams import VerifyStream, same_gpu
from saguaro.runtime.lanes.thread import ThreadLane


@dataclass(frozen=True)
class LaneKind:
    """How to start one kind of lane for an owner, and which kind stands in when it cannot start."""

    start: Callable[[LaneOwner], DraftLane]
    falls_back_to: str | None  # None: the generation runs as SD (AR when the Program has no local draft)
    retry_each_call: bool = False  # a start failure is forgotten at the next generate, not at close()
    shares_host: bool = True  # the draft computes on the target's machine (CPU threads are split)


def _start_thread(owner: LaneOwner) -> DraftLane:
    return ThreadLane(
        SpeculationServer(owner.draft, owner.config), owner.draft.spec.device, owner.config.lane_timeout_s
    )


def _start_process(owner: LaneOwner) -> DraftLane:
    from saguaro.runtime.lanes.process import ProcessLane  # subprocess machinery only when used

    return ProcessLane(
        owner.remote_draft, owner.config, owner.config.lane_start_timeout_s, owner.config.lane_timeout_s
    )


def _start_remote(owner: LaneOwner) -> DraftLane:
    from saguaro.runtime.lanes.remote import RemoteLane  # sockets and torch.distributed only when used

    return RemoteLane(
        owner.remote_draft, owner.config, owner.config.lane_start_timeout_s, owner.config.lane_timeout_s
    )


LANES: dict[str, LaneKind] = {
    "thread": LaneKind(_start_thread, falls_back_to=None),
    "process": LaneKind(_start_process, falls_back_to="thread"),
    "remote": LaneKind(_start_remote, falls_back_to=None, retry_each_call=True, shares_host=False),
}


def register_lane(
    kind: str,
    start: Callable[[LaneOwner], DraftLane],
    falls_back_to: str | None,
    retry_each_call: bool = False,
    shares_host: bool = True,
) -> None:
    """Make ``lane=kind`` start lanes with ``start(owner)``; ``ValueError`` for an unknown fallback kind."""
    if falls_back_to is not None and falls_back_to not in LANES:
        raise ValueError(
            f"lane kind {kind!r} falls back to {falls_back_to!r}, which is not registered "
            f"(registered: {', '.join(sorted(LANES))})"
        )
    LANES[kind] = LaneKind(start, falls_back_to, retry_each_call, shares_host)


def lane_kind(config: SaguaroConfig, device_type: str) -> str:
    """The configured lane; for ``"auto"`` the process lane for the eager backend on CPU (the GIL makes a
    thread lane slow the target down there), else the thread lane."""
    if config.lane != "auto":
        return config.lane
    return "process" if device_type == "cpu" and config.backend == "eager" else "thread"


class LaneOwner:
    """Owns at most one draft lane. ``remote_draft`` rebuilds the draft in a draft process (or is the remote
    lane's ``RemoteEndpoint``); ``draft`` is the in-process runner, None when the draft is remote only."""

    def __init__(self, config: SaguaroConfig, draft: ModelRunner | None, remote_draft):
        self.config = config
        self.draft = draft
        self.remote_draft = remote_draft
        self.configured_kind = lane_kind(config, draft.spec.device.type if draft is not None else "cpu")
        if self.configured_kind not in LANES:
            raise ValueError(
                f"lane={self.configured_kind!r} is not a registered lane kind "
                f"(registered: {', '.join(sorted(LANES))})"
            )
        self.kind = self.configured_kind
        self.failure: DraftLaneError | None = None  # why no lane can start (remembered until close)
        self.failed_lanes = 0  # lanes dropped after a failure, mid-generation or at a call's start
        self._client: DraftClient | None = None
        self._finalizer = None
        self._verify_stream = VerifyStream()  # the target's high-priority stream while a lane shares its GPU

    def lane(self) -> DraftClient | None:
        """The lane's client, started on first use down the fallback chain; None when no lane can start."""
        while self._client is None and self.failure is None:
            try:
                lane = LANES[self.kind].start(self)
            except DraftLaneError as exc:
                fallback = LANES[self.kind].falls_back_to
                if fallback is None:
                    self.failure = exc
                    alone = "SD" if self.draft is not None else "AR"  # AR: the only draft is a remote one
                    warn_at_caller(f"saguaro: {exc}; generating with {alone} instead (output stays exact)")
                    return None
                warn_at_caller(
                    f"saguaro: the {self.kind} lane cannot start: {exc}; SSD uses the {fallback} "
                    "lane instead until close()"
                )
                self.kind = fallback
                continue
            self._client = DraftClient(lane)
            self._finalizer = weakref.finalize(self, lane.close)
        return self._client

    def started(self) -> DraftClient | None:
        """The started lane's client, or None; starts nothing."""
        return self._client

    @property
    def shares_host(self) -> bool:
        """Whether the current lane's draft computes on the target's machine."""
        return LANES[self.kind].shares_host

    @contextmanager
    def ssd_context(self, device: torch.device):
        """Where SSD's rounds run, the target on ``device``: one intra-op thread per lane where the draft
        shares the target's CPU, a :class:`~.streams.VerifyStream` where it shares its GPU."""
        gpu = self.shares_host and self.draft is not None and same_gpu(device, self.draft.spec.device)
        threads = one_thread_per_lane(device) if self.shares_host else nullcontext()
        with threads, self._verify_stream.over(device, gpu):
            yield

    def begin_call(self) -> None:
        """A ``generate`` begins: a ``retry_each_call`` kind's start failure is forgotten."""
        if self.failure is not None and LANES[self.configured_kind].retry_each_call:
            self.failure = None
            self.kind = self.configured_kind

    def drop(self) -> None:
        """Stop a lane that failed mid-generation; the next :meth:`lane` starts a new one."""
        if self._client is not None:
            self.failed_lanes += 1
            self._stop()

    def _stop(self) -> None:
        if self._client is not None:
            self._finalizer()
            self._client = None

    def close(self) -> None:
        """Stop the lane and forget any start failure: the next :meth:`lane` starts the configured kind."""
        self._stop()
        self.failure = None
        self.kind = self.configured_kind
