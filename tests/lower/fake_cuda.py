"""A CPU stand-in for the parts of ``torch.cuda`` that ``saguaro.lower.cuda_graphs`` (and the runtime's
stream logic) calls, so the CUDA branch's logic (signatures, static buffers, warm-up, capture, replay,
fallback, a stream's priority and the waits between streams) runs on CPU.

It keeps CUDA's semantics where they matter: while a graph captures, the "kernels" a stage launches do
not run but are recorded; a replay runs the recorded kernels again on the same tensors. A stage opts in
by launching through :meth:`FakeCuda.launch`, or by being wrapped in :class:`Kernelized`, which turns a
whole call into one kernel (the capture leaves every argument as it was, as a real capture does).
"""

from __future__ import annotations

import contextlib
import threading

import torch


class FakeStream:
    def __init__(self, cuda: FakeCuda, name: str, device=None, priority: int = 0):
        self.cuda, self.name, self.device, self.priority = cuda, name, device, priority
        self.waited_on: list[str] = []

    def wait_stream(self, other: FakeStream) -> None:
        self.waited_on.append(other.name)
        self.cuda.events.append(("wait", self.name, other.name))


class FakeGraph:
    def __init__(self, cuda: FakeCuda):
        self.cuda, self.kernels, self.replays = cuda, [], 0

    def replay(self) -> None:
        self.replays += 1
        self.cuda.events.append(("replay", id(self)))
        for kernel in self.kernels:
            kernel()


class FakeCuda:
    """Install with :meth:`install` (a ``monkeypatch``); ``fail_capture`` makes the next captures raise."""

    def __init__(self):
        self.current = FakeStream(self, "current")
        self.active: FakeStream = self.current
        self._local = threading.local()  # captures are per thread (capture_error_mode="thread_local")
        self.events: list = []
        self.streams: list[FakeStream] = []  # every torch.cuda.Stream made, in order
        self.capture_kwargs: list[dict] = []
        self.fail_capture = False

    @property
    def capturing(self) -> FakeGraph | None:
        """The graph this thread is capturing, if any."""
        return getattr(self._local, "graph", None)

    @capturing.setter
    def capturing(self, graph: FakeGraph | None) -> None:
        self._local.graph = graph

    def install(self, monkeypatch) -> FakeCuda:
        monkeypatch.setattr(torch.cuda, "Stream", self.new_stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.active)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "stream", self.stream)
        monkeypatch.setattr(torch.cuda, "graph", self.graph)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: FakeGraph(self))
        monkeypatch.setattr(torch.cuda, "device", self.device)
        return self

    def new_stream(self, device=None, priority: int = 0) -> FakeStream:
        """``torch.cuda.Stream``: named "side", or "high-priority" below the default priority 0."""
        stream = FakeStream(self, "side" if priority >= 0 else "high-priority", device, priority)
        self.streams.append(stream)
        return stream

    @contextlib.contextmanager
    def device(self, device):
        self.events.append(("device", str(device)))
        yield

    @contextlib.contextmanager
    def stream(self, stream: FakeStream):
        previous, self.active = self.active, stream
        self.events.append(("stream", stream.name))
        try:
            yield
        finally:
            self.active = previous

    @contextlib.contextmanager
    def graph(self, graph: FakeGraph, stream=None, capture_error_mode="global", pool=None):
        self.capture_kwargs.append({"stream": stream, "capture_error_mode": capture_error_mode})
        if self.fail_capture:
            raise RuntimeError("operation not permitted when stream is capturing\nmore detail")
        self.capturing = graph
        self.events.append(("capture", id(graph), stream.name if stream is not None else None))
        try:
            with self.stream(stream if stream is not None else FakeStream(self, "capture")):
                yield
        finally:
            self.capturing = None

    def launch(self, kernel) -> None:
        """Run ``kernel`` now, or record it in the graph being captured."""
        if self.capturing is not None:
            self.capturing.kernels.append(kernel)
        else:
            kernel()


class Kernelized:
    """``fn`` as one kernel: outside a capture it runs; inside one, it is recorded, and its outputs are
    tensors that each replay refills (the arguments are left untouched by the capture itself). ``perturb``
    (a graph that replays wrong): called with the static outputs after each replay has refilled them."""

    def __init__(self, fn, cuda: FakeCuda, perturb=None):
        self.fn, self.cuda, self.calls, self.perturb = fn, cuda, 0, perturb

    def __call__(self, *args):
        self.calls += 1
        if self.cuda.capturing is None or getattr(self.cuda._local, "learning", False):
            return self.fn(*args)  # not captured, or inside another kernel (SD's round around its stages)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        saved = [t.clone() for t in tensors]
        self.cuda._local.learning = True
        try:
            outputs = self.fn(*args)  # to learn the outputs' shapes; then undone
        finally:
            self.cuda._local.learning = False
        for tensor, before in zip(tensors, saved):
            tensor.copy_(before)
        static = tuple(torch.full_like(o, -7) for o in outputs)  # garbage until a replay fills them

        def kernel():
            for out, value in zip(static, self.fn(*args)):
                out.copy_(value)
            if self.perturb is not None:
                self.perturb(static)

        self.cuda.capturing.kernels.append(kernel)
        return static
