"""CUDA graphs over the fixed-shape stages (:func:`captures_stage`): :class:`GraphedStage`.

Per input signature (shapes, dtypes, the addresses of the inputs written in place, kept fixed by the
runtime) a stage keeps static input buffers, a ``torch.cuda.CUDAGraph`` and its outputs: the first call
warms up on a side stream (it compiles), the second captures, later ones copy their inputs in, replay and
return clones. A failed capture leaves that signature ungraphed; :data:`MAX_GRAPHS` keep theirs. Each
graph's first replay is checked bit for bit against the stage run without it (on copies of the written
inputs); a difference turns the stage's graphs off for good (:attr:`GraphedStage.graphs_off`). Not
``mode="reduce-overhead"``: its graph trees skip graphs that write non-parameter inputs, and are per thread.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import torch

from saguaro.core.errors import ConfigError
from saguaro.core.stages import TARGET_PREFILL, TARGET_SCORE, Stage
from saguaro.lower.compile_helper import mark_dynamic

log = logging.getLogger(__name__)

# cuda_graphs="auto" on CUDA: on; the probe found every stage bound by its launches
# (docs/measurements/2026-12-04-gpu-probe-first-run.md)
CUDA_GRAPHS_AUTO = True
CUDA_GRAPHS_CHOICES = ("auto", True, False)
MAX_GRAPHS = 16  # signatures per stage that keep a captured graph
WARMUP_CALLS = 1  # calls per signature before its capture
# torch.cuda.graph synchronizes the device as a capture starts, which would break another thread's
_CAPTURE_LOCK = threading.Lock()
_ENCLOSED = threading.local()  # depth: > 0 while an enclosing GraphedStage's function runs on this thread


def resolve_cuda_graphs(requested, device) -> bool:
    """Whether a model on ``device`` graphs its fixed-shape stages (``"auto"``: on CUDA when
    :data:`CUDA_GRAPHS_AUTO`); ``ConfigError`` for ``True`` off CUDA or another value."""
    device = torch.device(device)
    if requested == "auto":
        return device.type == "cuda" and CUDA_GRAPHS_AUTO
    if requested is True and device.type != "cuda":
        raise ConfigError(
            f"cuda_graphs=True needs the models on a CUDA device, but they are on {device}: "
            "use cuda_graphs=False or 'auto' (off there), or move the models to CUDA"
        )
    if requested not in (True, False):
        raise ConfigError(f"cuda_graphs={requested!r} is not allowed: choose 'auto', True or False")
    return bool(requested)


def captures_stage(stage: Stage) -> bool:
    """Whether ``stage`` has fixed shapes: all but the prefill and the score (lengths vary per call)."""
    return stage.family not in (TARGET_PREFILL.family, TARGET_SCORE.family)


class _Entry:
    """One signature's static inputs (``(arg index, buffer)``), graph and static outputs."""

    def __init__(self, args: tuple, fixed: frozenset, dynamic_dims: dict):
        self.copies = [
            (i, torch.empty(a.shape, dtype=a.dtype, device=a.device))  # contiguous
            for i, a in enumerate(args)
            if isinstance(a, torch.Tensor) and i not in fixed
        ]
        if dynamic_dims:  # the marks CompiledStage put on the inputs, on the buffers dynamo compiles for
            buffers = dict(self.copies)
            mark_dynamic([buffers.get(i) for i in range(len(args))], dynamic_dims)
        self.calls = 0
        self.checked = False  # its first replay was compared with the stage run without it
        self.failed = False  # its capture failed: the stage runs itself
        self.graph = None
        self.outputs = None

    def load(self, args: tuple) -> tuple:
        """Copy ``args`` into the static buffers; the arguments to call the stage with."""
        call_args = list(args)
        for i, buffer in self.copies:
            buffer.copy_(args[i])
            call_args[i] = buffer
        return tuple(call_args)


def _cloned(out):
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (tuple, list)):
        return type(out)(_cloned(o) for o in out)
    return out


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes ``[numel, itemsize]`` (uint8): equal bytes, equal bits (NaN payloads, -0.0 included)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8).view(t.numel(), -1)


def difference(got: list, want: list, names: list) -> str | None:
    """The first of ``got`` unlike ``want`` (shape, dtype, a bit), named by ``names``, in words; else None."""
    for name, a, b in zip(names, got, want):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{name}: {tuple(a.shape)} {a.dtype} instead of {tuple(b.shape)} {b.dtype}"
        if a.numel() and not torch.equal(_bits(a), _bits(b)):
            n = int((_bits(a) != _bits(b)).any(dim=1).sum())
            return f"{name} {tuple(a.shape)} {a.dtype}: {n} of {a.numel()} elements differ"
    return None


def enclosing(fn):
    """``fn`` with the stages it calls running as themselves (no graph of their own) on this thread."""

    def call(*args):
        _ENCLOSED.depth = getattr(_ENCLOSED, "depth", 0) + 1
        try:
            return fn(*args)
        finally:
            _ENCLOSED.depth -= 1

    return call


class GraphedStage:
    """``fn`` (flat tensors in, a tuple out) replayed as CUDA graphs, one per signature; ``fixed``: positions
    of the inputs it writes in place. A call off ``device_type`` or unhashable runs ``fn``; outputs: clones.
    ``encloses``: ``fn`` calls stages (SD's round), run as themselves while it warms up, captures or checks.
    """

    def __init__(
        self,
        fn,
        name: str,
        fixed=(),
        device_type: str = "cuda",
        max_graphs: int = MAX_GRAPHS,
        warmup_calls: int = WARMUP_CALLS,
        dynamic_dims: dict | None = None,
        encloses: bool = False,
    ):
        self.fn = fn
        self.name = name
        self.fixed = frozenset(fixed)
        self._run = enclosing(fn) if encloses else fn  # what its warm-ups, captures and checks call
        self.device_type = device_type
        self.max_graphs = max_graphs
        self.warmup_calls = warmup_calls
        self.dynamic_dims = dict(dynamic_dims or {})
        self._entries: OrderedDict = OrderedDict()  # signature -> _Entry, least recently used first
        self._streams: dict = {}  # device -> the side stream of warm-ups and captures
        self._lock = threading.Lock()  # static buffers are shared by the calls of one signature
        self.counts = {
            "passed": 0,
            "warmups": 0,
            "captures": 0,
            "replays": 0,
            "failed": 0,
            "evicted": 0,
            "checks": 0,
            "mismatches": 0,
            "enclosed": 0,
        }
        self.mismatch: str | None = None  # why a first replay differed: the whole stage runs without graphs
        self.capture_error: str | None = None  # the last failed capture's error (that signature runs without)

    @property
    def graphs_off(self) -> str | None:
        """Why calls of this stage run without CUDA graphs, in words (None: every signature graphs)."""
        if self.mismatch is not None:
            return self.mismatch
        if self.capture_error is not None:
            return f"capture failed for {self.counts['failed']} shape(s): {self.capture_error}"
        return None

    def signature(self, args: tuple):
        """The key of ``args``' graph, or None when they cannot run one."""
        device, parts = None, []
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                if a.device.type != self.device_type or (device is not None and a.device != device):
                    return None
                device = a.device
                if i in self.fixed:  # written in place by the graph: its address is part of it
                    parts.append((a.data_ptr(), a.shape, a.stride(), a.dtype))
                else:
                    parts.append((a.shape, a.dtype))
            else:
                parts.append(("constant", a))  # baked into the graph
        if device is None:
            return None
        key = (device, torch.is_inference_mode_enabled(), torch.is_grad_enabled(), tuple(parts))
        try:
            hash(key)
        except TypeError:
            return None
        return key

    def __call__(self, *args):
        if getattr(_ENCLOSED, "depth", 0):  # inside an enclosing stage's warm-up, capture or check
            self.counts["enclosed"] += 1
            return self.fn(*args)
        key = None if self.mismatch is not None else self.signature(args)
        if key is None:
            self.counts["passed"] += 1
            return self.fn(*args)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Entry(args, self.fixed, self.dynamic_dims)
                while len(self._entries) > self.max_graphs:
                    self._entries.popitem(last=False)  # its graph and memory pool go with it
                    self.counts["evicted"] += 1
            else:
                self._entries.move_to_end(key)
            if entry.failed:
                self.counts["passed"] += 1
                return self.fn(*args)
            call_args = entry.load(args)
            entry.calls += 1
            if entry.graph is None and entry.calls <= self.warmup_calls:
                return self._warm_up(key[0], call_args)
            if entry.graph is None and not self._capture(entry, key[0], call_args):
                self.counts["passed"] += 1
                return self.fn(*args)
            if not entry.checked:
                return self._first_replay(entry, call_args)
            entry.graph.replay()
            self.counts["replays"] += 1
            return _cloned(entry.outputs)

    def _first_replay(self, entry: _Entry, call_args: tuple):
        """Replay ``entry``'s graph the first time, checked against the stage run without it."""
        entry.checked = True
        self.counts["checks"] += 1
        written = sorted(
            i for i in self.fixed if i < len(call_args) and isinstance(call_args[i], torch.Tensor)
        )
        before = {i: call_args[i].clone() for i in written}  # clone keeps the strides of a dense tensor
        entry.graph.replay()
        self.counts["replays"] += 1
        expected = self._run(*(before.get(i, a) for i, a in enumerate(call_args)))  # the copies are written
        got, want = _tensors(entry.outputs), _tensors(expected)
        names = [f"output {n}" for n in range(max(len(got), len(want)))]
        why = (
            f"{len(got)} outputs instead of {len(want)}"
            if len(got) != len(want)
            else difference(
                got + [call_args[i] for i in written],
                want + [before[i] for i in written],
                names + [f"input {i} (written in place)" for i in written],
            )
        )
        if why is None:
            return _cloned(entry.outputs)
        for i in written:  # the ungraphed call's writes stand
            call_args[i].copy_(before[i])
        self.counts["mismatches"] += 1
        self.mismatch = f"the first replay of its CUDA graph differs from the stage run without it: {why}"
        self._entries.clear()  # graphs and their memory pools go: the stage runs itself from now on
        log.warning("stage %s: %s; the stage runs without CUDA graphs from now on", self.name, self.mismatch)
        return expected

    def _stream(self, device: torch.device):
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def _warm_up(self, device: torch.device, call_args: tuple):
        """Run the stage on the side stream (it compiles here, on the static buffers)."""
        self.counts["warmups"] += 1
        stream, current = self._stream(device), torch.cuda.current_stream(device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            out = self._run(*call_args)
        current.wait_stream(stream)
        for tensor in _tensors(out):  # made on the side stream, used on the caller's
            if tensor.is_cuda:
                tensor.record_stream(current)
        return out

    def _capture(self, entry: _Entry, device: torch.device, call_args: tuple) -> bool:
        """Capture the stage over the static buffers; False (logged) when it cannot be captured."""
        graph = torch.cuda.CUDAGraph()
        try:
            # the device's own: torch.cuda.graph synchronizes and captures on the current device;
            # thread_local: the other lane's thread may allocate or synchronize while this one captures
            with _CAPTURE_LOCK, torch.cuda.device(device):
                with torch.cuda.graph(graph, stream=self._stream(device), capture_error_mode="thread_local"):
                    outputs = self._run(*call_args)
        except Exception as exc:
            entry.failed = True
            self.counts["failed"] += 1
            # a capture that ended in error may leave the allocator routing this stream's allocations to
            # the graph's pool: later warm-ups and captures take a new side stream
            self._streams.pop(device, None)
            self.capture_error = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
            log.warning(
                "stage %s: CUDA graph capture failed (%s); this shape runs without a graph",
                self.name,
                self.capture_error,
            )
            return False
        entry.graph, entry.outputs = graph, outputs
        self.counts["captures"] += 1
        log.info("stage %s: captured a CUDA graph (%d captured)", self.name, self.counts["captures"])
        return True
