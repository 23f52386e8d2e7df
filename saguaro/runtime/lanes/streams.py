"""CUDA-stream ordering between a caller and an in-process lane, and the verify's high-priority stream.

:class:`StreamHandoff` orders both crossings of a lane method by events and ``record_stream``, never a
host sync (off CUDA it only moves tensors between devices). :class:`VerifyStream` runs the caller's
side of SSD on a high-priority stream while the lane shares the target's GPU."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import contextmanager

import torch

from saguaro.runtime.base.model_runner import to_device


def map_tensors(value, fn: Callable):
    """``value`` with ``fn(t)`` for every tensor in it (tuples, lists, dicts, dataclasses, recursively); a
    container whose tensors are unchanged is returned itself, a changed dataclass is a new instance."""
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
    """``tensor`` is used on ``stream``: its memory is not reused before that stream's work is done."""
    tensor.record_stream(stream)


@dataclasses.dataclass(frozen=True)
class Ticket:
    """A method's arguments on the lane's device, the caller's device, and on CUDA the caller's stream and
    its ``ready`` event."""

    args: tuple
    caller: torch.device
    caller_stream: object = None
    ready: object = None


@dataclasses.dataclass(frozen=True)
class Reply:
    """A method's result on the caller's device; on CUDA the caller's stream and the lane's ``done`` event."""

    value: object
    caller_stream: object = None
    done: object = None


class StreamHandoff:
    """Orders the hand-offs between callers and one lane working on ``device``; owns the lane's
    :attr:`stream` on CUDA (None elsewhere)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._caller = self.device  # the caller's device, as its last tensors showed it

    def send(self, args: tuple) -> Ticket:
        """On the caller's thread: ``args`` for the lane; the result goes back to the device of the first
        tensor in ``args`` (or of the last call that had one)."""
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
        """On the lane's thread: ``method(*ticket.args)`` on the lane's stream after the caller's earlier
        work; the result on the caller's device."""
        back = lambda t: to_device(t, ticket.caller)
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
        """On the caller's thread: the result, the caller's stream ordered after the lane's work."""
        if reply.done is None:
            return reply.value
        reply.caller_stream.wait_event(reply.done)
        for tensor in tensors_in(reply.value):
            _record_stream(tensor, reply.caller_stream)
        return reply.value


HIGH_PRIORITY = -1  # torch.cuda.Stream(priority=-1): scheduled ahead of the lane's stream (priority 0)


def same_gpu(a: torch.device, b: torch.device | None) -> bool:
    """Whether ``a`` and ``b`` are the same CUDA device (an index-less ``cuda`` is the current one)."""
    if b is None or torch.device(a).type != "cuda" or torch.device(b).type != "cuda":
        return False
    index = lambda d: d.index if d.index is not None else torch.cuda.current_device()
    return index(torch.device(a)) == index(torch.device(b))


class VerifyStream:
    """A high-priority CUDA stream per device for the caller's side of SSD: :meth:`over` runs a block on
    it after the caller's stream's work, and the caller's stream waits for the block (events only)."""

    def __init__(self):
        self._streams: dict = {}

    @contextmanager
    def over(self, device: torch.device, active: bool = True):
        """The block on ``device``'s high-priority stream if ``active`` and CUDA; else nothing changes."""
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
