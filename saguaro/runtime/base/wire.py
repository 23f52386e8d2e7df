"""Fixed-layout tensor messages over a two-rank ``torch.distributed`` process group: no pickle.

This module knows nothing of sockets, secrets or draft servers; any two processes that share a
process group (gloo, NCCL) can exchange :class:`Message` s through a :class:`Channel`:

    channel = Channel(group, peer=1 - group.rank(), device=torch.device("cpu"))
    sent = channel.send(code=3, seq=7, tensors=[ids, None, probs])   # starts the sends
    sent.wait()                                                      # the peer has taken them
    message = channel.recv(codes={3}, seq=7)                         # validated before use

A message is a header, one int64 tensor of :data:`HEADER_LEN` numbers, then up to
:data:`MAX_TENSORS` payload tensors (tag ``i + 1`` for slot ``i``; a slot may be None)::

    [MAGIC, VERSION, code, seq, count, (dtype id, ndim, d0, d1, d2, d3) × MAX_TENSORS, 0 ...]

Everything received is checked against :class:`Limits` before a byte of payload is allocated: the
magic and version, the code against the codes the caller accepts, the sequence number, the count,
each slot's dtype (an allow-list, :data:`DTYPES`), rank and sizes (no negative size, at most
``max_numel`` elements and ``max_bytes`` in all). A peer can therefore send only numbers of an
announced shape; what they mean is for the caller to check. A violation raises :class:`WireError`;
the stream is then out of step and the caller must drop the group.

Ordering: gloo and NCCL deliver point-to-point messages of one tag in order, and a receiver posts the
header first, so a sender may start its sends before the receiver is listening (``send`` returns at
once; ``Sent.wait`` blocks until the transport has taken the data). A receiver should only call
``recv`` when it knows a message is coming (a gloo receive that times out closes the pair), for
example after a doorbell on another channel.

A traced generation's draft-side events travel as JSON text and are checked field by field
(:func:`check_trace_part`) before they reach the trace.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass

import torch

from saguaro.core.errors import SaguaroError

MAGIC = 0x53475257  # "SGRW"
VERSION = 1
MAX_TENSORS = 8
MAX_NDIM = 4
SLOT = 2 + MAX_NDIM  # dtype id, ndim, sizes
HEADER_LEN = 64  # 5 + MAX_TENSORS * SLOT = 53 used
# the only dtypes a message may carry; id 0 is an empty slot (None)
DTYPES = (None, torch.int64, torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.uint8,
          torch.bool, torch.int32)


class WireError(SaguaroError):
    """A message broke the layout or the limits (or the transport failed mid-message)."""


@dataclass(frozen=True)
class Limits:
    """What a receiver accepts in one message."""

    max_numel: int = 1 << 28  # elements in one tensor
    max_bytes: int = 1 << 31  # bytes in all tensors of a message


@dataclass
class Message:
    """A received message: its ``code``, ``seq`` and the payload ``tensors`` (None for an empty slot)."""

    code: int
    seq: int
    tensors: list


class Sent:
    """The sends of one message in flight; :meth:`wait` blocks until the transport has taken them."""

    def __init__(self, works: list, timeout: datetime.timedelta | None):
        self.works, self.timeout = works, timeout

    def wait(self) -> None:
        try:
            for work in self.works:
                work.wait() if self.timeout is None else work.wait(self.timeout)
        except RuntimeError as exc:
            raise WireError(f"sending a message failed: {exc}") from exc


class Channel:
    """Messages to and from ``peer`` in ``group`` (a ``torch.distributed`` ProcessGroup, e.g. a
    ``ProcessGroupGloo`` of two ranks). Tensors travel on ``device`` (CPU for gloo; the CUDA device for
    NCCL); received tensors are allocated there."""

    def __init__(self, group, peer: int, device: torch.device, limits: Limits = Limits(),
                 timeout_s: float | None = None):
        self.group, self.peer, self.device, self.limits = group, peer, torch.device(device), limits
        self.timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)

    def send(self, code: int, seq: int, tensors: list) -> Sent:
        """Start sending one message; the tensors are copied to the channel's device first (contiguous)."""
        if len(tensors) > MAX_TENSORS:
            raise WireError(f"a message holds at most {MAX_TENSORS} tensors, not {len(tensors)}")
        header = torch.zeros(HEADER_LEN, dtype=torch.long, device="cpu")  # [HEADER_LEN]
        header[:5] = torch.tensor([MAGIC, VERSION, code, seq, len(tensors)], device="cpu")
        payload = []
        for i, t in enumerate(tensors):
            if t is None:
                continue
            if t.dtype not in DTYPES or t.dim() > MAX_NDIM:
                raise WireError(f"slot {i}: dtype {t.dtype} / {t.dim()} dims cannot travel (allowed: "
                                f"{[d for d in DTYPES if d is not None]}, at most {MAX_NDIM} dims)")
            base = 5 + i * SLOT
            header[base] = DTYPES.index(t.dtype)
            header[base + 1] = t.dim()
            header[base + 2:base + 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.long, device="cpu")
            payload.append((i, t.detach().to(self.device).contiguous()))
        try:
            works = [self.group.send([header.to(self.device)], self.peer, 0)]
            works += [self.group.send([t], self.peer, i + 1) for i, t in payload if t.numel() > 0]
        except RuntimeError as exc:
            raise WireError(f"sending a message failed: {exc}") from exc
        return Sent(works, self.timeout)

    def recv(self, codes, seq: int | None = None) -> Message:
        """Receive one message whose code is in ``codes`` (and whose sequence number is ``seq``, when
        given); everything is checked before the payload is received."""
        header = torch.empty(HEADER_LEN, dtype=torch.long, device=self.device)
        self._wait(self.group.recv([header], self.peer, 0))
        h = header.cpu().tolist()
        if h[0] != MAGIC or h[1] != VERSION:
            raise WireError(f"not a message of this protocol (magic {h[0]:#x}, version {h[1]})")
        code, got_seq, count = h[2], h[3], h[4]
        if code not in codes:
            raise WireError(f"message code {code} is not one of the codes expected here {sorted(codes)}")
        if seq is not None and got_seq != seq:
            raise WireError(f"message out of sequence: number {got_seq}, expected {seq}")
        if not 0 <= count <= MAX_TENSORS or any(h[5 + count * SLOT:]):
            raise WireError(f"message announces {count} tensors (at most {MAX_TENSORS}) or has stray fields")
        specs, total = [], 0
        for i in range(count):
            dtype_id, ndim, *dims = h[5 + i * SLOT:5 + (i + 1) * SLOT]
            if dtype_id == 0:
                if ndim or any(dims):
                    raise WireError(f"slot {i}: an empty slot with sizes")
                specs.append(None)
                continue
            if not 0 < dtype_id < len(DTYPES) or not 0 <= ndim <= MAX_NDIM or any(dims[ndim:]):
                raise WireError(f"slot {i}: dtype id {dtype_id} / {ndim} dims is not allowed")
            shape = dims[:ndim]
            if any(d < 0 for d in shape):
                raise WireError(f"slot {i}: negative size in {shape}")
            numel = math.prod(shape)
            total += numel * DTYPES[dtype_id].itemsize
            if numel > self.limits.max_numel or total > self.limits.max_bytes:
                raise WireError(f"slot {i}: {shape} exceeds the limits ({self.limits})")
            specs.append((DTYPES[dtype_id], shape))
        tensors = []
        for i, spec in enumerate(specs):
            if spec is None:
                tensors.append(None)
                continue
            t = torch.empty(spec[1], dtype=spec[0], device=self.device)
            if t.numel() > 0:
                self._wait(self.group.recv([t], self.peer, i + 1))
            tensors.append(t)
        return Message(code, got_seq, tensors)

    def _wait(self, work) -> None:
        try:
            work.wait() if self.timeout is None else work.wait(self.timeout)
        except RuntimeError as exc:
            raise WireError(f"receiving a message failed: {exc}") from exc


TRACE_PHASES = frozenset("BECi")


def check_trace_part(part) -> dict:
    """A draft server's trace events (``TraceRecorder.take``'s dict) with every field checked: plain
    numbers and short strings only."""
    def short(s):
        return isinstance(s, str) and len(s) <= 256

    ok = isinstance(part, dict) and set(part) == {"pid", "process", "events"} and isinstance(part["pid"], int) \
        and short(part["process"]) and isinstance(part["events"], list)
    for event in part["events"] if ok else ():
        args = event[4] if isinstance(event, list) and len(event) == 5 else None
        ok = (isinstance(event, list) and len(event) == 5 and event[0] in TRACE_PHASES and short(event[1])
              and short(event[2]) and isinstance(event[3], int)
              and (args is None or (isinstance(args, dict) and len(args) <= 64 and all(
                  short(key) and (isinstance(v, (int, float)) or short(v)) for key, v in args.items()))))
        if not ok:
            break
    if not ok:
        raise WireError("the draft server's trace events do not have the expected form")
    part["events"] = [tuple(e) for e in part["events"]]
    return part
