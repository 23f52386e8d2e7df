"""The rank lane: SSD's draft lane of a tensor-parallel job, the draft rank ``N`` serving target ranks
``0..N-1`` with the remote lane's messages over one :class:`~saguaro.runtime.base.wire.Channel` per pair.
Rank 0 alone sends requests (the ranks make the same calls) and every rank gets each reply; no
doorbell, since an SSD generation always has a message coming, the last being ``BYE``."""

from __future__ import annotations

import logging

import torch

from saguaro.runtime.base.wire import Channel, WireError
from saguaro.runtime.lanes.protocol import DraftLaneError, Method
from saguaro.runtime.lanes.remote_messages import (
    BYE,
    CALL,
    ERROR,
    METHODS,
    POST,
    REPLY,
    REQUESTS,
    Bounds,
    decode_args,
    decode_result,
    decode_text,
    encode_args,
    encode_result,
    encode_text,
    sent_batch,
)

log = logging.getLogger(__name__)

KIND = "rank"
MAX_CAPACITY = 1 << 24  # KV slots a request may ask for (the ranks of one job trust each other's sizes)


class RankLink:
    """A target rank's end of the rank lane: its pair group with the draft rank and the message count."""

    def __init__(self, rank: int, pair_group, device: torch.device, vocab: int, k: int):
        self.rank = rank
        self.channel = Channel(pair_group, peer=1, device=device)  # {r, N}: the draft rank is the pair's 1
        self.bounds = Bounds(vocab, k, MAX_CAPACITY)
        self.device = device
        self.seq = 0

    def send(self, code: int, tensors: list) -> None:
        """Rank 0 sends the request; every target rank counts it."""
        self.seq += 1
        if self.rank == 0:
            try:
                self.channel.send(code, self.seq, tensors).wait()
            except WireError as exc:
                raise DraftLaneError(f"the draft rank is unreachable: {exc}") from exc

    def bye(self) -> None:
        """The SSD generation ended: the draft rank stops serving it."""
        self.send(BYE, [])


class RankLane:
    """The :class:`~saguaro.runtime.lanes.protocol.DraftLane` of a target rank."""

    kind = KIND
    recorder = None

    def __init__(self, link: RankLink):
        self.link = link

    def _send(self, method: Method, code: int, args: tuple) -> None:
        sent_batch(self.link.bounds, method, args)
        self.link.send(code, encode_args(method, args) if self.link.rank == 0 else [])

    def post(self, method: Method, *args) -> None:
        self._send(method, POST + METHODS.index(method), args)

    def call(self, method: Method, *args, timeout_s: float | None = None):
        """Run ``method`` on the draft rank after what was posted; every target rank gets the result, within
        the job's process-group timeout."""
        index = METHODS.index(method)
        self._send(method, CALL + index, args)
        try:
            message = self.link.channel.recv({REPLY + index, ERROR}, seq=self.link.seq)
        except WireError as exc:
            raise DraftLaneError(f"bad reply from the draft rank to {method.value}: {exc}") from exc
        if message.code == ERROR:
            text = decode_text(message.tensors[0] if message.tensors else None, "error")
            raise DraftLaneError(f"the draft rank failed in {method.value}: {text[:2000]}")
        return decode_result(method, message.tensors, self.link.bounds, self.link.device)

    def settle(self) -> None:
        """Nothing to wait for: the draft rank's unneeded last build ends on its own."""

    def take_trace(self) -> list[dict]:
        """No events: tracing the draft rank is not wired yet."""
        return []

    def close(self) -> None:
        """The pair groups belong to the job; nothing to stop."""


def serve_generation(server, channels: list, vocab: int, k: int, seq: int) -> int:
    """On the draft rank: serve one SSD generation's requests from ``channels[0]`` until ``BYE``, each
    reply to every target rank; ``seq`` is the last number before it, the ``BYE``'s is returned."""
    bounds = Bounds(vocab, k, MAX_CAPACITY)
    failure = None
    while True:
        message = channels[0].recv(REQUESTS, seq=seq + 1)
        seq = message.seq
        if message.code == BYE:
            return seq
        reply = message.code >= CALL
        method = METHODS[message.code - (CALL if reply else POST)]
        try:
            args = decode_args(method, message.tensors, bounds)
            if failure is not None and method not in (Method.OPEN, Method.WARM_UP):
                raise failure
            failure = None
            result = method.bound_to(server)(*args)
            code, tensors = REPLY + METHODS.index(method), encode_result(method, result) if reply else []
        except Exception as exc:
            log.warning("draft rank: %s failed: %s", method.value, exc)
            failure = exc
            code, tensors = ERROR, [encode_text(f"{type(exc).__name__}: {exc}")]
        if reply:
            sent = [channel.send(code, seq, tensors) for channel in channels]  # all started, then waited for
            for one in sent:
                one.wait()
