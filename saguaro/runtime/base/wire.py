"""Fixed-layout tensor messages over a two-rank ``torch.distributed`` group (gloo, NCCL): no pickle, and
nothing of sockets, secrets or draft servers (docs/design.md, "The remote lane"). A message is a header,
one int64 tensor of :data:`HEADER_LEN` numbers, then up to :data:`MAX_TENSORS` payload tensors (tag
``i + 1`` for slot ``i``, None allowed)::

    [MAGIC, VERSION, code, seq, count, (dtype id, ndim, d0, d1, d2, d3) × MAX_TENSORS, 0 ...]

:meth:`Channel.recv` checks all of it against the expected codes, :data:`DTYPES` and :class:`Limits`
before allocating a byte; a violation is :class:`WireError`, after which the caller must drop the
group. Call ``recv`` only when a message is known to be coming (a timed-out gloo receive closes the pair)."""

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
DTYPES = (
    None,
    torch.int64,
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.uint8,
    torch.bool,
    torch.int32,
)


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
    """Messages to and from ``peer`` in ``group`` (a two-rank ProcessGroup), carried on ``device`` (CPU for
    gloo, the CUDA device for NCCL), where received tensors are allocated."""

    def __init__(
        self,
        group,
        peer: int,
        device: torch.device,
        limits: Limits = Limits(),
        timeout_s: float | None = None,
    ):
        self.group, self.peer, self.device, self.limits = group, peer, torch.device(device), limits
        self.timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)

    def send(self, code: int, seq: int, tensors: list) -> Sent:
        """Start sending one message (tensors copied to the channel's device, contiguous); ``WireError`` for
        more than :data:`MAX_TENSORS` tensors, a dtype or rank that cannot travel, a transport failure."""
        if len(tensors) > MAX_TENSORS:
            raise WireError(f"a message holds at most {MAX_TENSORS} tensors, not {len(tensors)}")
        header = torch.zeros(HEADER_LEN, dtype=torch.long, device="cpu")  # [HEADER_LEN]
        header[:5] = torch.tensor([MAGIC, VERSION, code, seq, len(tensors)], device="cpu")
        payload = []
        for i, t in enumerate(tensors):
            if t is None:
                continue
            if t.dtype not in DTYPES or t.dim() > MAX_NDIM:
                raise WireError(
                    f"slot {i}: dtype {t.dtype} / {t.dim()} dims cannot travel (allowed: "
                    f"{[d for d in DTYPES if d is not None]}, at most {MAX_NDIM} dims)"
                )
            base = 5 + i * SLOT
            header[base] = DTYPES.index(t.dtype)
            header[base + 1] = t.dim()
            header[base + 2 : base + 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.long, device="cpu")
            payload.append((i, t.detach().to(self.device).contiguous()))
        try:
            works = [self.group.send([header.to(self.device)], self.peer, 0)]
            works += [self.group.send([t], self.peer, i + 1) for i, t in payload if t.numel() > 0]
        except RuntimeError as exc:
            raise WireError(f"sending a message failed: {exc}") from exc
        return Sent(works, self.timeout)

    def recv(self, codes, seq: int | None = None) -> Message:
        """Receive one message whose code is in ``codes`` (and number is ``seq``, when given), everything
        checked before the payload is received; ``WireError`` otherwise."""
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
        if not 0 <= count <= MAX_TENSORS or any(h[5 + count * SLOT :]):
            raise WireError(f"message announces {count} tensors (at most {MAX_TENSORS}) or has stray fields")
        specs, total = [], 0
        for i in range(count):
            dtype_id, ndim, *dims = h[5 + i * SLOT : 5 + (i + 1) * SLOT]
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
