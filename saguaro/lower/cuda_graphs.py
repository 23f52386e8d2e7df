"""CUDA graphs over the fixed-shape stages (verify, glue, each tree shape, step).

On CUDA every kernel of a stage is launched from Python (Inductor's wrapper, or the FX interpreter of
the eager backend), so two lanes launching hundreds of kernels per round contend for the GIL. A
:class:`GraphedStage` launches a stage as one captured ``torch.cuda.CUDAGraph`` instead: per input
signature (shapes and dtypes, plus the addresses of the inputs the graph writes in place) it keeps
static input buffers, a captured graph and the graph's static outputs. A call copies its inputs into
the static buffers, replays the graph, and returns clones of the outputs (a tree stage is called once
per depth at one shape, so an uncloned output would be overwritten by the next depth).

The KV caches are written in place, so they are never copied: their addresses are part of the
signature, and a graph replays only for caches at the addresses it was captured with. The runtime's
stores keep fixed addresses across generations (``KVStore`` with a ``KVPool``), so a graph captured
in one generation replays in every later one of the same shape.

Why not ``torch.compile(mode="reduce-overhead")``: its CUDA graph trees skip any graph that mutates an
input which is not a parameter or buffer (the caches), and they are per thread, while a lane may
build a stage that another thread runs. Explicit graphs keep both under our control.

Per signature: the first call is a warm-up on a side stream, as ``torch.cuda.graph``'s documentation
requires (it compiles, with the static buffers, so that the capture never compiles); the second call
captures (which runs nothing) and replays; later calls replay. Each call so runs the stage once. A
capture that fails is logged once, and that signature runs without a graph from then on. Only the
:data:`MAX_GRAPHS` most recently used signatures keep their graph (and its private memory pool).
Captures take turns across the process (one lock), as CUDA graphs require.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import torch

from saguaro.core.errors import ConfigError
from saguaro.core.stages import TARGET_PREFILL, Stage

log = logging.getLogger(__name__)

# What cuda_graphs="auto" means on CUDA. Off until benchmarks/gpu_probe.py shows graphed stages exact
# (tokens equal to the ungraphed program) and faster on a GPU; then this one line turns them on.
CUDA_GRAPHS_AUTO = False
CUDA_GRAPHS_CHOICES = ("auto", True, False)
MAX_GRAPHS = 16  # signatures per stage that keep a captured graph
WARMUP_CALLS = 1  # calls per signature before its capture
# torch.cuda.graph synchronizes the device when it starts a capture, which would break a capture
# under way on another thread (the other lane's): captures take turns
_CAPTURE_LOCK = threading.Lock()


def resolve_cuda_graphs(requested, device) -> bool:
    """Whether a model on ``device`` runs its fixed-shape stages as CUDA graphs. ``"auto"``: on CUDA
    when :data:`CUDA_GRAPHS_AUTO`; ``True`` off CUDA is a :class:`ConfigError` naming the device."""
    device = torch.device(device)
    if requested == "auto":
        return device.type == "cuda" and CUDA_GRAPHS_AUTO
    if requested is True and device.type != "cuda":
        raise ConfigError(f"cuda_graphs=True needs the models on a CUDA device, but they are on {device}: "
                          "use cuda_graphs=False or 'auto' (off there), or move the models to CUDA")
    if requested not in (True, False):
        raise ConfigError(f"cuda_graphs={requested!r} is not allowed: choose 'auto', True or False")
    return bool(requested)


def captures_stage(stage: Stage) -> bool:
    """Whether ``stage`` has fixed shapes worth a graph: all but prefill, whose prompt length varies
    per request and which runs once per generation."""
    return stage.family != TARGET_PREFILL.family


class _Entry:
    """One signature's static inputs (``(arg index, buffer)``), graph and static outputs."""

    def __init__(self, args: tuple, fixed: frozenset):
        self.copies = [(i, torch.empty(a.shape, dtype=a.dtype, device=a.device))  # contiguous
                       for i, a in enumerate(args) if isinstance(a, torch.Tensor) and i not in fixed]
        self.calls = 0
        self.graph = None
        self.outputs = None
        self.failed = False  # its capture failed: calls run the stage itself

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


class GraphedStage:
    """``fn`` (a stage: flat tensors in, a tuple of tensors out) replayed as CUDA graphs, one per input
    signature; ``fixed`` are the positions of the inputs ``fn`` writes in place (kept at their
    addresses, which join the signature). Calls with an input off ``device_type`` (or on two devices,
    or an unhashable constant) run ``fn`` itself. Outputs are fresh tensors (clones of the static ones).
    """

    def __init__(self, fn, name: str, fixed=(), device_type: str = "cuda", max_graphs: int = MAX_GRAPHS,
                 warmup_calls: int = WARMUP_CALLS):
        self.fn, self.name, self.fixed = fn, name, frozenset(fixed)
        self.device_type, self.max_graphs, self.warmup_calls = device_type, max_graphs, warmup_calls
        self._entries: OrderedDict = OrderedDict()  # signature -> _Entry, least recently used first
        self._streams: dict = {}  # device -> the side stream of warm-ups and captures
        self._lock = threading.Lock()  # static buffers are shared by the calls of one signature
        self.counts = {"passed": 0, "warmups": 0, "captures": 0, "replays": 0, "failed": 0, "evicted": 0}

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
        key = self.signature(args)
        if key is None:
            self.counts["passed"] += 1
            return self.fn(*args)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                entry = self._entries[key] = _Entry(args, self.fixed)
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
            entry.graph.replay()
            self.counts["replays"] += 1
            return _cloned(entry.outputs)

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
            out = self.fn(*call_args)
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
                    outputs = self.fn(*call_args)
        except Exception as exc:  # noqa: BLE001 - any capture failure falls back to running the stage
            entry.failed = True
            self.counts["failed"] += 1
            # a capture that ended in error may leave the allocator routing this stream's allocations to
            # the graph's pool: later warm-ups and captures take a new side stream
            self._streams.pop(device, None)
            log.warning("stage %s: CUDA graph capture failed (%s: %s); this shape runs without a graph",
                        self.name, type(exc).__name__, str(exc).strip().splitlines()[0] if str(exc).strip() else "")
            return False
        entry.graph, entry.outputs = graph, outputs
        self.counts["captures"] += 1
        log.info("stage %s: captured a CUDA graph (%d captured)", self.name, self.counts["captures"])
        return True
