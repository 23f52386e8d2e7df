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
"""

from __future__ import annotations

import dataclasses
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
