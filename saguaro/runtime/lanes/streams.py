"""The hand-off between a caller and an in-process lane that runs on a CUDA stream of its own.

A method sent to the lane crosses twice: its arguments from the caller to the lane, its result back.
On CUDA both sides queue work asynchronously on different streams (maybe of different devices, with
``draft_device``), so each crossing is ordered by an event, never by a host synchronisation:

1. :meth:`StreamHandoff.send` (the caller's thread): the argument tensors are copied to the lane's
   device (non-blocking; a copy between devices runs on the source's current stream, here the
   caller's), then an event ``ready`` is recorded on the caller's current stream.
2. :meth:`StreamHandoff.serve` (the lane's thread, or the caller's while the lane is idle): the lane's
   stream waits for ``ready``, marks every argument tensor as used on it (``record_stream``: the
   caching allocator does not reuse the caller's memory before the lane's reads are done), runs the
   method on it, copies the result's tensors to the caller's device (on the lane's stream) and records
   ``done`` on it.
3. :meth:`StreamHandoff.receive` (the caller's thread): the caller's stream waits for ``done`` and marks
   every result tensor as used on it (``record_stream``), before the caller queues anything that reads
   them.

So no hand-off relies on a host synchronisation (the host still waits for the lane's Python, as the
lane protocol says, and a server method may read its own results to the host), and nothing either side
computes is read by the other before it is written, nor its memory reused while the other reads it. On CPU (the lane's
device is not CUDA) there are no streams: :meth:`send` and :meth:`serve` only move tensors to the
other side's device (nothing moves when both are the same), and :meth:`receive` returns the result.

Where the lane's draft shares the target's GPU, the two compete for it: the lane's build is queued while
the target verifies, and on the device their kernels interleave. The caller's side of SSD (the verify
and what the round queues around it) then runs on a high-priority stream (:class:`VerifyStream`), so
the GPU's scheduler runs the verify's kernels ahead of the build's waiting ones and the critical path
(the verify) is slowed down as little as the build allows; the lane's stream keeps the default priority.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import Callable

import torch

from saguaro.runtime.base.model_runner import to_device


def map_tensors(value, fn: Callable):
    """``value`` with ``fn(t)`` for every tensor ``t`` in it (in tuples, lists, dicts and dataclass
    instances, recursively). A container none of whose tensors changed is returned itself (never a copy),
    so an object a server keeps is never modified: a changed dataclass is a new instance."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        items = [map_tensors(v, fn) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return type(value)(items) if not hasattr(value, "_fields") else type(value)(*items)
    if isinstance(value, dict):
        items = {key: map_tensors(v, fn) for key, v in value.items()}
        return value if all(items[key] is v for key, v in value.items()) else items
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changed = {}
        for field in dataclasses.fields(value):
            if not field.init:
                continue
            old = getattr(value, field.name)
            new = map_tensors(old, fn)
            if new is not old:
                changed[field.name] = new
        return dataclasses.replace(value, **changed) if changed else value
    return value


def tensors_in(value) -> list[torch.Tensor]:
    """Every tensor in ``value`` (as :func:`map_tensors` finds them)."""
    found: list[torch.Tensor] = []
    map_tensors(value, lambda t: found.append(t) or t)
    return found


def _record_stream(tensor: torch.Tensor, stream) -> None:
    """``tensor`` is used on ``stream``: its memory is not reused before the work queued there is done."""
    tensor.record_stream(stream)


@dataclasses.dataclass(frozen=True)
class Ticket:
    """A method's arguments on their way to the lane: on the lane's device, with the caller's device
    (where the result goes back), and on CUDA the caller's stream and the ``ready`` event recorded on it."""

    args: tuple
    caller: torch.device
    caller_stream: object = None
    ready: object = None


@dataclasses.dataclass(frozen=True)
class Reply:
    """A method's result on its way back: on the caller's device; on CUDA with the caller's stream and
    the ``done`` event recorded on the lane's stream after the result (and its copies) were queued."""

    value: object
    caller_stream: object = None
    done: object = None


class StreamHandoff:
    """Orders the hand-offs between callers and one lane whose work runs on ``device`` (see the module
    docstring). On CUDA it owns the lane's stream (:attr:`stream`); on any other device it has none."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._caller = self.device  # the caller's device, as its last tensors showed it

    def send(self, args: tuple) -> Ticket:
        """On the caller's thread: ``args`` for the lane. The caller's device is that of the first tensor
        in ``args`` (or of the last call that had one): the result goes back there."""
        found = tensors_in(args)
        if found:
            self._caller = found[0].device
        caller = self._caller
        moved = map_tensors(args, lambda t: to_device(t, self.device))
        if self.stream is None:
            return Ticket(moved, caller)
        caller_stream = torch.cuda.current_stream(caller)
        ready = torch.cuda.Event()
        ready.record(caller_stream)  # after the copies above, which ran on the caller's stream
        return Ticket(moved, caller, caller_stream, ready)

    def serve(self, ticket: Ticket, method: Callable) -> Reply:
        """On the thread that runs the lane: ``method(*ticket.args)`` on the lane's stream, after the work
        the caller queued before sending; its result on the caller's device."""
        back = lambda t: to_device(t, ticket.caller)  # noqa: E731
        if self.stream is None:
            return Reply(map_tensors(method(*ticket.args), back))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ticket.ready)
            for tensor in tensors_in(ticket.args):
                _record_stream(tensor, self.stream)
            value = map_tensors(method(*ticket.args), back)  # copies run on the lane's stream
            done = torch.cuda.Event()
            done.record(self.stream)
        return Reply(value, ticket.caller_stream, done)

    def receive(self, reply: Reply):
        """On the caller's thread: the result, with the caller's stream ordered after the lane's work."""
        if reply.done is None:
            return reply.value
        reply.caller_stream.wait_event(reply.done)
        for tensor in tensors_in(reply.value):
            _record_stream(tensor, reply.caller_stream)
        return reply.value


HIGH_PRIORITY = -1  # torch.cuda.Stream(priority=-1): scheduled ahead of the lane's stream (priority 0)


def same_gpu(a: torch.device, b: torch.device | None) -> bool:
    """Whether ``a`` and ``b`` are the same CUDA device (an index-less ``cuda`` is the current device)."""
    if b is None or torch.device(a).type != "cuda" or torch.device(b).type != "cuda":
        return False
    index = lambda d: d.index if d.index is not None else torch.cuda.current_device()  # noqa: E731
    return index(torch.device(a)) == index(torch.device(b))


class VerifyStream:
    """A high-priority CUDA stream per device for the caller's side of SSD while the draft lane shares its
    GPU. :meth:`over` runs a block on it, ordered after what the caller's stream queued before and with the
    caller's stream ordered after the block (events, no host synchronisation): every entry waits for the
    caller's stream, so memory this stream freed is only reused after the caller's work on it."""

    def __init__(self):
        self._streams: dict = {}

    @contextmanager
    def over(self, device: torch.device, active: bool = True):
        """The block on the high-priority stream of ``device`` if ``active`` and ``device`` is CUDA; else
        nothing changes (CPU: no streams)."""
        device = torch.device(device)
        if not active or device.type != "cuda":
            yield None
            return
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device, priority=HIGH_PRIORITY)
        caller = torch.cuda.current_stream(device)
        stream.wait_stream(caller)
        try:
            with torch.cuda.stream(stream):
                yield stream
        finally:
            caller.wait_stream(stream)
