"""Tiered compilation (``compile="background"``): a stage runs eager while Inductor compiles it behind.

A :class:`TieredStage` runs its GraphModule for shapes not compiled yet and queues a :class:`CompileJob` on
the compile thread (:mod:`saguaro.lower.compile_thread`); once done, those shapes run compiled. Both forms
compute the same graph (greedy tokens are the same; a sampled generation may switch forms mid-run, so a seed
reproduces only with ``compile="blocking"``). The thread never sees live tensors: it runs on scratch
arguments of the same layout (:func:`scratch_args`) under the caller's :func:`call_modes`. It relies on
dynamo's frame hook being per thread (docs/measurements/2026-12-07-figures-from-passes-lower.md).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch

from saguaro.lower.compile_thread import BackgroundCompiler
from saguaro.lower.repeated_call import repeated_call

log = logging.getLogger(__name__)


def call_modes() -> tuple:
    """The caller's state dynamo guards on: inference mode, grad mode, intra-op threads."""
    return torch.is_inference_mode_enabled(), torch.is_grad_enabled(), torch.get_num_threads()


def shape_key(args, read=None) -> tuple:
    """What a compiled form depends on: :func:`call_modes`, and per argument of ``read`` (default all) a
    tensor's sizes, strides, dtype, device and first position (aliasing), else its value (a float's type)."""
    seen: dict = {}
    key = list(call_modes())
    for i in range(len(args)) if read is None else read:
        a = args[i]
        if isinstance(a, torch.Tensor):
            key.append((a.shape, a.stride(), a.dtype, a.device, seen.setdefault(id(a), len(seen))))
        else:
            key.append(float if isinstance(a, float) else a)
    return tuple(key)


class KeyPositions:
    """The positions a stage's :func:`shape_key` reads: all but the written inputs (the KV caches, sized by
    the slot tables) after the first of them."""

    def __init__(self, written):
        self.written = frozenset(written)
        self._by_count: dict = {}  # argument count -> positions

    def key(self, args) -> tuple:
        read = self._by_count.get(len(args))
        if read is None:
            first = min(self.written, default=None)
            read = self._by_count[len(args)] = tuple(
                i for i in range(len(args)) if i not in self.written or i == first
            )
        return shape_key(args, read)


@dataclass(frozen=True)
class Blank:
    """A written input (a KV cache) of a compile job, made zeroed in the compile thread."""

    shape: torch.Size
    stride: tuple
    dtype: torch.dtype
    device: torch.device
    inference: bool

    def make(self) -> torch.Tensor:
        with torch.inference_mode(self.inference):
            return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device).zero_()


def clone_like(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its strides and storage offset (an expanded view too), inference as ``t`` is."""
    with torch.inference_mode(t.is_inference()):
        copy = t.clone()  # preserve_format: a dense tensor keeps its strides
        if copy.stride() != t.stride() or copy.storage_offset() != t.storage_offset():
            storage = t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0).clone()
            copy = storage.as_strided(t.shape, t.stride(), t.storage_offset())
    return copy


def scratch_args(args, written) -> list:
    """A compile's arguments: a :class:`Blank` per ``written`` input, a clone of each other tensor (once)."""
    copies: dict = {}
    out = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            if id(a) not in copies:
                copies[id(a)] = (
                    Blank(a.shape, a.stride(), a.dtype, a.device, a.is_inference())
                    if i in written
                    else clone_like(a)
                )
            a = copies[id(a)]
        out.append(a)
    for device in {a.device for a in out if isinstance(a, torch.Tensor) and a.is_cuda}:
        torch.cuda.current_stream(device).synchronize()  # the clones ran on the caller's stream
    return out


def materialise(args: list) -> list:
    """:func:`scratch_args` with each :class:`Blank` made a tensor (one tensor for a Blank repeated)."""
    made: dict = {}
    for a in args:
        if isinstance(a, Blank) and id(a) not in made:
            made[id(a)] = a.make()
    return [made[id(a)] if isinstance(a, Blank) else a for a in args]


@dataclass
class CompileJob:
    """One stage and shape key to compile, on scratch ``args`` under ``modes``; ``helper``: ``""``,
    ``"sent"``, ``"done"`` or ``"failed"`` (:mod:`saguaro.lower.compile_helper`)."""

    stage: TieredStage
    key: tuple
    args: list
    modes: tuple
    helper: str = ""

    @property
    def helper_serves(self) -> bool:
        return bool(getattr(self.stage.compiled, "helper_serves", False))

    def helper_request(self) -> dict | None:
        """The compile helper's request for this job, or None where a helper cannot serve its stage."""
        request = getattr(self.stage.compiled, "helper_request", None)
        return None if request is None else request(self.args, self.modes)

    def run(self) -> None:
        args = materialise(self.args)
        inference, grad, threads = self.modes
        saved = torch.get_num_threads()
        if threads != saved:
            torch.set_num_threads(threads)
        try:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                self.stage.compiled(*args)
        finally:
            if threads != saved:
                torch.set_num_threads(saved)


class TieredStage:
    """A stage run ``compiled`` (a :class:`~saguaro.lower.lowering.CompiledStage`) for the shape keys it has
    compiled, ``gm`` eager for the others while ``compiler`` compiles them; ``blocking``
    (``Program.compile_blocking``): new shapes compile on the caller's thread."""

    def __init__(
        self, gm: torch.fx.GraphModule, compiled, name: str, compiler: BackgroundCompiler, written=()
    ):
        self.gm = gm
        self.compiled = compiled
        self.name = name
        self.compiler = compiler
        self.written = frozenset(written)
        self._positions = KeyPositions(self.written)
        self.eager_calls = 0
        self.compiled_calls = 0
        self._ready: set = set()  # shape keys the compiled form serves
        self._queued: set = set()  # shape keys queued, compiling, or whose compile failed
        self._failures = 0
        self._lock = threading.Lock()
        self.blocking = False  # set by compile_blocking(): a new shape compiles on the caller's thread

    compile_s = property(lambda self: self.compiled.compile_s, doc="the first compile's seconds, or None")
    repeated = repeated_call  # a RepeatedCall where these shapes run compiled, else None
    output_code = property(lambda self: self.compiled.output_code, doc="what Inductor generated (kernel_log)")

    def __call__(self, *args):
        key = self._positions.key(args)
        if key in self._ready:
            self.compiled_calls += 1
            return self.compiled(*args)
        with self._lock:
            queue = key not in self._queued
            compile_here = queue and self.blocking
            if not compile_here:
                self._queued.add(key)
        if compile_here:  # blocking from now on: as a CompiledStage is (a failure raises LoweringError)
            out = self.compiled(*args)
            self._ready.add(key)
            self.compiled_calls += 1
            return out
        if queue:
            self.compiler.submit(CompileJob(self, key, scratch_args(args, self.written), call_modes()))
        self.eager_calls += 1
        return self.gm(*args)

    def compiled_for(self, key: tuple) -> None:
        self._ready.add(key)

    def dropped(self, key: tuple) -> None:
        with self._lock:
            self._queued.discard(key)

    def failed_for(self, key: tuple, exc: BaseException) -> None:
        """Keep these shapes eager for good; warn on the first failure."""
        self._failures += 1
        if self._failures == 1:
            log.warning(
                "background compile of stage %s failed (%s: %s); it keeps running eager for those shapes",
                self.name,
                type(exc).__name__,
                str(exc).strip().splitlines()[0] if str(exc).strip() else "",
            )
