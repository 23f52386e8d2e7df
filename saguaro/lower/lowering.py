"""Lowering: a stage GraphModule to a callable on a backend (eager or Inductor), and the shape buckets."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from saguaro.core.errors import ConfigError, SaguaroError
from saguaro.lower.compile_helper import inductor_settings, mark_dynamic
from saguaro.lower.compile_thread import BackgroundCompiler
from saguaro.lower.cuda_graphs import GraphedStage
from saguaro.lower.direct_call import (
    compile_with_inductor,
    direct_call,
    direct_calls_wanted,
    held_tensors,
    recording,
)
from saguaro.lower.forward_code import forward_outside_compiles, responsible_node
from saguaro.lower.graph_inputs import mutated_inputs
from saguaro.lower.kernel_log import capture_output_code
from saguaro.lower.repeated_call import repeated_call
from saguaro.lower.tiered import KeyPositions, TieredStage

log = logging.getLogger(__name__)
# Compile progress, a record as a stage starts / ends compiling (extra: compile_event, stage, seconds)
PROGRESS_LOGGER = "saguaro.lower.progress"
progress = logging.getLogger(PROGRESS_LOGGER)

BACKENDS = ("eager", "inductor")

# Inductor options per device type, per compile (never set globally). CPU: the C++ wrapper (a small draft's
# stages are bound by per-call overhead), built apart from the kernels and at a lower optimisation level;
# kernels that read the thread count at run time, so SSD's one-thread lanes reuse the code from Inductor's
# cache; no size asserts (dynamo's guards or a direct call's key fix the sizes); one pooled allocation for the
# intermediate buffers. Measured: docs/measurements/2026-12-03-wrapper-serial-work.md and
# docs/measurements/2026-12-07-figures-from-passes-lower.md.
INDUCTOR_OPTIONS = {
    "cpu": {
        "cpp_wrapper": True,
        "cpp_wrapper_build_separate": True,
        "cpp.dynamic_threads": True,
        "size_asserts": False,
        "memory_planning": True,
    },
    "cuda": {},
}
# A packed stage's own Inductor kernels (norms, rotary embedding: small) run on one thread; the ops split
# their loops themselves (docs/measurements/2026-12-06-packed-one-row.md)
SERIAL_KERNELS = {"cpp.dynamic_threads": False, "cpp.threads": 1}
# linears="template": a config patch around each compiling call (freezing is not a torch.compile option).
# Autotuning keeps the faster of the C++ GEMM template and ATen's call; Inductor's FX graph cache skips such a
# graph, so it compiles again in every process (docs/measurements/2026-12-02-template-gemm.md)
TEMPLATE_GEMM_CONFIG = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
COMPILE_LOG_S = 1.0  # a stage call this slow compiled (a new shape bucket, say): log it
# Inductor's shape buckets: prompt columns and KV slots rounded up to these multiples (few shapes, few graphs).
# On the CPU a stage's prompt length is dynamic from its first compile, so prompts are not padded to
# PROMPT_BUCKET (its columns cost prefill time: docs/measurements/2026-12-07-unpadded-prompts.md), only to
# MIN_PROMPT_COLUMNS: a one-column prompt would compile a graph of its own (a size of 1 specialises)
PROMPT_BUCKET, CAPACITY_BUCKET = 16, 64
MIN_PROMPT_COLUMNS = 2


def bucketed(n: int, step: int) -> int:
    """``n`` rounded up to a multiple of ``step``."""
    return -(-n // step) * step


@dataclass(frozen=True)
class ShapePolicy:
    """The shapes the runtime feeds a backend's stages: prompts left-padded (masked) to a multiple of
    ``prompt_bucket`` columns and to ``min_prompt`` columns at least, KV capacities rounded up to a multiple of
    ``capacity_bucket`` slots."""

    prompt_bucket: int = 1
    capacity_bucket: int = 1
    min_prompt: int = 1

    def capacity(self, slots: int) -> int:
        return bucketed(slots, self.capacity_bucket)

    def pad_prompt(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_token_id: int):
        """``input_ids, attention_mask [B, T]`` left-padded to the bucket: ``[B, T']``, ``T' >= T``."""
        T = input_ids.shape[1]
        extra = max(bucketed(T, self.prompt_bucket), self.min_prompt) - T
        if extra == 0:
            return input_ids, attention_mask
        pad = input_ids.new_full((input_ids.shape[0], extra), pad_token_id)  # [B, extra]
        return torch.cat([pad, input_ids], dim=1), torch.cat([torch.zeros_like(pad), attention_mask], dim=1)


def shape_policy(backend: str, device_type: str = "cpu") -> ShapePolicy:
    """Inductor: KV slots rounded up to :data:`CAPACITY_BUCKET`; prompts padded to :data:`PROMPT_BUCKET` on CUDA (a
    CUDA graph is captured per shape), to :data:`MIN_PROMPT_COLUMNS` elsewhere. Eager: any shape (buckets of 1)."""
    if backend != "inductor":
        return ShapePolicy()
    if device_type == "cuda":
        return ShapePolicy(PROMPT_BUCKET, CAPACITY_BUCKET)
    return ShapePolicy(1, CAPACITY_BUCKET, MIN_PROMPT_COLUMNS)


class LoweringError(SaguaroError):
    """A stage graph could not be compiled; the message names the stage and the FX node."""


def lower_graph(
    gm: torch.fx.GraphModule,
    backend: str,
    name: str,
    device_type: str = "cpu",
    cuda_graphs: bool = False,
    compiler: BackgroundCompiler | None = None,
    dynamic_dims: dict | None = None,
    eager_gm: torch.fx.GraphModule | None = None,
    config_patch: dict | None = None,
    serial_kernels: bool = False,
):
    """The stage ``gm`` (named ``name``) as a callable on ``backend``: ``"eager"``, ``gm`` itself;
    ``"inductor"``, a :class:`CompiledStage` (:data:`INDUCTOR_OPTIONS` of ``device_type``; ``serial_kernels``:
    :data:`SERIAL_KERNELS`) compiling on the first call per shape, ``dynamic_dims`` (``{position: dims}``)
    dynamic and ``config_patch`` around it; with ``cuda_graphs`` a ``GraphedStage`` inside, with ``compiler``
    a ``TieredStage`` around (``eager_gm`` meanwhile). ``ValueError`` for another backend, ``ConfigError``
    for ``cuda_graphs`` off CUDA."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not allowed: choose one of {', '.join(BACKENDS)}")
    if cuda_graphs and device_type != "cuda":
        raise ConfigError(f"cuda_graphs=True needs a CUDA device, but stage {name} runs on {device_type}")
    if backend == "eager":
        return GraphedStage(gm, name, mutated_inputs(gm)) if cuda_graphs else gm
    if backend == "inductor":
        log.info("lowering %s with inductor (compiled on its first call per shape)", name)
        # the forward itself, not GraphModule.__call__, whose error wrapper hides a failed compile's error
        options = dict(INDUCTOR_OPTIONS.get(device_type, {}))
        if serial_kernels and device_type == "cpu":
            options.update(SERIAL_KERNELS)
        forward_outside_compiles(gm)
        compiled = compile_with_inductor(gm, options)
        if cuda_graphs:  # inside CompiledStage, which maps compile errors and logs the kernels
            compiled = GraphedStage(compiled, name, mutated_inputs(gm), dynamic_dims=dynamic_dims)
        stage = CompiledStage(
            gm,
            compiled,
            name,
            dynamic_dims,
            config_patch,
            options if device_type == "cpu" and not cuda_graphs else None,
        )
        if compiler is not None and not cuda_graphs:
            return TieredStage(gm if eager_gm is None else eager_gm, stage, name, compiler, stage.written)
        return stage


class CompiledStage:
    """A stage under Inductor: ``compiled(*args)``, logged on :data:`PROGRESS_LOGGER` when a call brings a
    new shape key, a compiler failure raised as :class:`LoweringError` naming the FX node, later calls of a
    key past dynamo where :mod:`~saguaro.lower.direct_call` allows. ``helper_options``: the Inductor options
    a compile helper compiles it with (None: no helper)."""

    # why its CUDA graphs are off (GraphedStage's), None otherwise
    graphs_off = property(lambda self: getattr(self.compiled, "graphs_off", None))

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        compiled,
        name: str,
        dynamic_dims: dict | None = None,
        config_patch: dict | None = None,
        helper_options: dict | None = None,
    ):
        self.gm, self.compiled, self.name = gm, compiled, name
        self.config_patch = dict(config_patch or {})
        self.helper_options = helper_options
        self.helper_setup: tuple = ()  # "module:function" names the helper calls first (an op library)
        self._packed: dict | None = None  # the graph as the compile helper gets it, made once
        self.dynamic_dims = dict(dynamic_dims or {})
        self.calls = 0
        self.compile_s: float | None = None  # the first call, compile included
        self.output_code: list[dict] = []  # what Inductor generated on the first call (kernel_log)
        self.keys: set = set()  # the shape keys it has run
        self.written = frozenset(mutated_inputs(gm))  # the KV caches
        self._positions = KeyPositions(self.written)
        # shape key -> DirectCall, or None for dynamo's path; off under CUDA graphs or SAGUARO_DIRECT_CALLS=0
        self.direct_calls = not isinstance(compiled, GraphedStage) and direct_calls_wanted()
        self._direct: dict = {}
        self._held = held_tensors(gm) if self.direct_calls else {}

    def repeated(self, args, varying: int):
        """A :class:`~saguaro.lower.repeated_call.RepeatedCall` for calls like ``self(*args)``, or None."""
        return repeated_call(self, args, varying)

    @property
    def direct_keys(self) -> int:
        """Shape keys whose calls reach Inductor's function without dynamo."""
        return sum(call is not None for call in self._direct.values())

    @property
    def graph_keys(self) -> int:
        """Of those, the keys that call Inductor's graph itself, past AOT autograd's wrapper."""
        return sum(call is not None and call.boxed is not None for call in self._direct.values())

    @property
    def helper_serves(self) -> bool:  # see helper_request
        return self.helper_options is not None and not self.config_patch.get("freezing")

    def helper_request(self, args: list, modes: tuple) -> dict | None:
        """The compile helper's request for scratch ``args`` under ``modes``; None without helper options or
        with frozen weights (the FX graph cache skips those)."""
        if not self.helper_serves:
            return None
        if self._packed is None:
            from saguaro.lower.graph_transport import pack_graph

            self._packed = pack_graph(self.gm)
        return {
            "graph": self._packed,
            "args": args,
            "modes": modes,
            "dynamic_dims": self.dynamic_dims,
            "options": self.helper_options,
            "config_patch": self.config_patch,
            "setup": self.helper_setup,
        }

    def __call__(self, *args):
        self.calls += 1
        key = self._positions.key(args)
        direct = self._direct.get(key) if self.direct_calls else None
        if direct is not None and direct.applies():
            return direct(args)
        new = key not in self.keys
        if new:
            progress.info(
                "compiling stage %s with inductor",
                self.name,
                extra={"compile_event": "start", "stage": self.name, "seconds": 0.0},
            )
            mark_dynamic(args, self.dynamic_dims)
        started = time.perf_counter()
        try:
            with inductor_settings(self.config_patch if new else None):
                with recording() as calls:
                    if self.calls == 1:
                        with capture_output_code() as files:
                            out = self.compiled(*args)
                        self.output_code, self.compile_s = files, time.perf_counter() - started
                    else:
                        out = self.compiled(*args)
        except Exception as exc:
            from torch._dynamo.exc import BackendCompilerFailed, TorchRuntimeError, Unsupported

            if new:
                progress.info(
                    "stage %s did not compile",
                    self.name,
                    extra={
                        "compile_event": "failed",
                        "stage": self.name,
                        "seconds": time.perf_counter() - started,
                    },
                )

            if isinstance(exc, (BackendCompilerFailed, TorchRuntimeError, Unsupported)):
                node = responsible_node(self.gm, exc)
                where = f" at FX node {node!r}" if node else ""
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise LoweringError(f"inductor could not compile stage {self.name}{where}: {first}") from exc
            raise
        elapsed = time.perf_counter() - started
        if self.direct_calls and key not in self._direct:
            self._direct[key] = direct_call(calls, args, out, self._held)
            log.debug(
                "stage %s: calls of a new shape key go %s",
                self.name,
                "past dynamo" if self._direct[key] else "through dynamo (inputs not rebuilt)",
            )
        if new:
            self.keys.add(key)
            progress.info(
                "stage %s compiled in %.1fs (call %d)",
                self.name,
                elapsed,
                self.calls,
                extra={"compile_event": "done", "stage": self.name, "seconds": elapsed},
            )
        elif elapsed > COMPILE_LOG_S:  # a recompile the shape key did not foresee
            log.info("stage %s: call %d (compile included) took %.1fs", self.name, self.calls, elapsed)
        return out
