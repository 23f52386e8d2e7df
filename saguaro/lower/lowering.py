"""Lowering: a stage GraphModule → a callable on a backend (eager or inductor)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from saguaro.core.errors import ConfigError, SaguaroError
from saguaro.core.stages import (DRAFT_CHAIN, DRAFT_STEP, DRAFT_TREE, TARGET_ROUND, TARGET_STEP, TARGET_VERIFY,
                                  TARGET_VERIFY_ROUND, Stage)
from saguaro.lower.cuda_graphs import GraphedStage
from saguaro.lower.direct_call import (compile_with_inductor, direct_call, direct_calls_wanted, held_tensors,
                                       recording)
from saguaro.lower.forward_code import forward_outside_compiles, responsible_node
from saguaro.lower.graph_inputs import mutated_inputs
from saguaro.lower.kernel_log import capture_output_code
from saguaro.lower.repeated_call import repeated_call
from saguaro.core.linear_choice import linear_implementation  # noqa: F401 - lowering's public choice of linears
from saguaro.lower.compile_helper import inductor_settings, mark_dynamic
from saguaro.lower.compile_thread import BackgroundCompiler
from saguaro.lower.tiered import KeyPositions, TieredStage

log = logging.getLogger(__name__)
# Compile progress: a record as a stage starts / ends compiling new shapes (``extra``: compile_event, stage, seconds)
PROGRESS_LOGGER = "saguaro.lower.progress"
progress = logging.getLogger(PROGRESS_LOGGER)

BACKENDS = ("eager", "inductor")

# Inductor options per device type (per compile, never set globally). On CPU the C++ wrapper calls the
# generated kernels without a Python wrapper in between: the stages of a small draft are bound by
# per-call overhead, not FLOPs. The wrapper (glue: allocations and kernel calls) is compiled apart from the
# kernels, at -O1 rather than at the kernels' -O3: g++ time of an AR program's two stages (tiny Gemma 2,
# precompiled headers warm) 13.7 / 14.6 s against 18.7 s in one file, the same tokens per second.
# The kernels take the thread count at run time (``cpp.dynamic_threads``; a packed stage's are serial, below), so
# a stage SSD's lanes run with one thread (dynamo recompiles it: it guards on the count) reuses the code compiled
# for all threads from Inductor's cache in about a second (7-8 s a stage to compile, default pair). No size
# asserts (a stage is called only with the sizes and strides it was compiled for: dynamo's guards, or the key of
# a direct call) and one pooled allocation for the intermediate buffers (``memory_planning``; 7 allocations a
# call of the default pair's AR round instead of 114): 0.91x the round's time (``benchmarks/README.md``).
INDUCTOR_OPTIONS = {"cpu": {"cpp_wrapper": True, "cpp_wrapper_build_separate": True, "cpp.dynamic_threads": True,
                            "size_asserts": False, "memory_planning": True},
                    "cuda": {}}
# A packed stage (linears and attention in the saguaro_kernels ops, which split their own loops over torch's
# threads) keeps Inductor's kernels (norms, rotary embedding, glue: a few hundred values a row) on one thread,
# where a parallel region (a fork, a barrier, a futex wake even at one thread) costs more than it saves.
SERIAL_KERNELS = {"cpp.dynamic_threads": False, "cpp.threads": 1}
# linears="template": the Inductor settings a stage compiles under (a config patch around its compiling calls:
# freezing is read outside the options torch.compile takes). Freezing makes the weights constants, which the
# CPU weight prepacking packs once; max-autotune with the C++ backend then offers the GEMM template (a
# register-blocked micro-kernel over the rows) beside ATen's call, and keeps the faster. Inductor's FX graph
# cache skips such a graph (its packed weights do not pickle): it compiles again in every process.
TEMPLATE_GEMM_CONFIG = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}
COMPILE_LOG_S = 1.0  # a stage call this slow compiled (a new shape bucket, say): log it
# Shape buckets of the inductor backend: the runtime left-pads prompts to a multiple of PROMPT_BUCKET columns
# and rounds KV capacities up to a multiple of CAPACITY_BUCKET slots (few shapes: few CUDA graphs).
PROMPT_BUCKET, CAPACITY_BUCKET = 16, 64


def bucketed(n: int, step: int) -> int:
    """``n`` rounded up to a multiple of ``step``."""
    return -(-n // step) * step


@dataclass(frozen=True)
class ShapePolicy:
    """The shapes the runtime feeds a backend's stages: prompts left-padded to a multiple of ``prompt_bucket``
    columns (masked; the runtime drops them from the result) and KV capacities rounded up to a multiple of
    ``capacity_bucket`` slots. Lowering owns it; ``saguaro.compile`` hands it to the runtime."""

    prompt_bucket: int = 1
    capacity_bucket: int = 1

    def capacity(self, slots: int) -> int:
        return bucketed(slots, self.capacity_bucket)

    def pad_prompt(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, pad_token_id: int):
        """``input_ids, attention_mask [B, T]`` left-padded to the bucket: ``[B, T']``, ``T' >= T``."""
        T = input_ids.shape[1]
        extra = bucketed(T, self.prompt_bucket) - T
        if extra == 0:
            return input_ids, attention_mask
        pad = input_ids.new_full((input_ids.shape[0], extra), pad_token_id)  # [B, extra]
        return torch.cat([pad, input_ids], dim=1), torch.cat([torch.zeros_like(pad), attention_mask], dim=1)


def shape_policy(backend: str) -> ShapePolicy:
    """Inductor takes shapes in buckets, not per request (few shapes, few CUDA graphs); eager takes any."""
    return ShapePolicy(PROMPT_BUCKET, CAPACITY_BUCKET) if backend == "inductor" else ShapePolicy()


# attention="auto" for the tree stage of Inductor on CUDA: FlexAttention (one Triton kernel Inductor
# generates for the tree's block mask, skipping the blocks no branch may see) instead of SDPA over the
# dense additive mask. Off until benchmarks/gpu_probe.py shows flex exact and faster than SDPA there;
# then this one line makes it the default (SDPA, "inline", stays the fallback everywhere else).
FLEX_TREE_ON_CUDA = False
# attention="auto" of Inductor on CPU for AR's target stages: "reduce", not SDPA (AR 1.13-1.17x; the draft's step 0.93-1.03x)
REDUCED_ATTENTION = (TARGET_STEP, TARGET_ROUND)
# attention="auto" of Inductor on CPU for SD's verify and the draft's step (and its chained form): the
# masked_attention C++ kernel (a verify's 6 rows over 256 slots 37 us against SDPA's 64; a draft step's row 7
# against 15), where it builds
KERNEL_ATTENTION = (*TARGET_VERIFY, TARGET_VERIFY_ROUND, *DRAFT_STEP, DRAFT_CHAIN)


def attention_implementation(backend: str, requested: str = "auto", device_type: str = "cpu",
                             mask: str | None = None, flex_tree: bool | None = None,
                             stage: Stage | None = None, kernel_built: bool = False) -> str:
    """How the ``lower_attention`` pass lowers the attention nodes of a stage with attention mask
    ``mask`` (``stage.mask``; None: any stage) on ``device_type``: ``requested`` unless ``"auto"``; then
    the custom op for the eager backend (``"kernel"`` for its stages, as below) and the op's math inline for Inductor (it fuses the KV write;
    the attention is one SDPA call per layer over the store, all ``MQ`` tree queries of a KV head in
    one call, so each tile of the shared prefix is read once for all branches), except the tree stage
    of Inductor on CUDA when ``flex_tree`` (default :data:`FLEX_TREE_ON_CUDA`, off until measured):
    ``"flex"`` there. ``"flex"`` (FlexAttention under an in-graph block mask) is opt-in for every stage:
    with torch 2.13 Inductor on CPU compiles it for multi-token stages but not for one-token steps,
    and it awaits a check on CUDA (``benchmarks/gpu_probe.py``). ``"reduce"``: Inductor on CPU, for the
    :data:`REDUCED_ATTENTION` ``stage`` (requested: those stages anywhere, the others inline). ``"kernel"``:
    Inductor on CPU, for the :data:`KERNEL_ATTENTION` ``stage`` where the ``saguaro_kernels`` library builds
    (``kernel_built``; requested: those stages on a CPU, the others inline)."""
    if requested == "reduce":
        return "reduce" if stage in REDUCED_ATTENTION else "inline"
    if requested == "kernel":
        return "kernel" if stage in KERNEL_ATTENTION and device_type == "cpu" else "inline"
    if requested != "auto":
        return requested
    if backend != "inductor":  # eager: the op, but the kernel's stages as on Inductor (the SDPA it replaces
        # costs the same in both; a batch of 16 served eager ran its rounds 10 % faster with it)
        return "kernel" if device_type == "cpu" and stage in KERNEL_ATTENTION and kernel_built else "op"
    flex_tree = FLEX_TREE_ON_CUDA if flex_tree is None else flex_tree
    if flex_tree and device_type == "cuda" and mask == DRAFT_TREE.greedy.mask:
        return "flex"
    if device_type == "cpu" and stage in REDUCED_ATTENTION:
        return "reduce"
    if device_type == "cpu" and stage in KERNEL_ATTENTION and kernel_built:
        return "kernel"
    return "inline"


class LoweringError(SaguaroError):
    """A stage graph could not be compiled; the message names the stage and the FX node."""


def lower_graph(gm: torch.fx.GraphModule, backend: str, name: str, device_type: str = "cpu",
                cuda_graphs: bool = False, compiler: BackgroundCompiler | None = None,
                dynamic_dims: dict | None = None, eager_gm: torch.fx.GraphModule | None = None,
                config_patch: dict | None = None, serial_kernels: bool = False):
    """``eager`` runs the GraphModule itself; ``inductor`` compiles it with ``torch.compile``
    (``fullgraph=True``: a graph break is an error). ``dynamic_dims`` (``{input position: (dimension,
    ...)}``, the sizes that change from call to call: query length, KV slots) are compiled dynamic from
    the first call, so one compile serves every prompt bucket and KV capacity (the runtime pads prompts
    and capacities to :data:`PROMPT_BUCKET` / :data:`CAPACITY_BUCKET` multiples); a size of 1 stays
    static (dynamo specialises it). Any other dimension that changes (a batch size, say) recompiles the
    stage once with it dynamic (dynamo's automatic dynamic shapes), so a stage never hits dynamo's
    recompile limit. Inductor's FX graph cache (on by default) serves repeated compiles of the same graph, in
    this process and the next. ``device_type`` picks the per-device options (:data:`INDUCTOR_OPTIONS`).
    ``cuda_graphs`` (CUDA only; a fixed-shape stage, :func:`~saguaro.lower.cuda_graphs.captures_stage`) replays
    the stage as CUDA graphs (:class:`~saguaro.lower.cuda_graphs.GraphedStage`), the inputs it writes in place
    (the KV caches, :func:`~saguaro.lower.graph_inputs.mutated_inputs`) kept at their addresses; Inductor
    compiles it with the same ``dynamic_dims`` (once), and a graph is captured per shape. ``compiler``
    (``compile="background"``; not with ``cuda_graphs``, which compiles blocking): a
    :class:`~saguaro.lower.tiered.TieredStage` that runs the GraphModule itself for shapes Inductor has not
    compiled yet while ``compiler``'s thread compiles them. ``config_patch`` (Inductor settings: :data:`TEMPLATE_GEMM_CONFIG`)
    around each call that compiles. ``serial_kernels`` (CPU): one-thread kernels (:data:`SERIAL_KERNELS`)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not allowed: choose one of {', '.join(BACKENDS)}")
    if cuda_graphs and device_type != "cuda":
        raise ConfigError(f"cuda_graphs=True needs a CUDA device, but stage {name} runs on {device_type}")
    if backend == "eager":
        return GraphedStage(gm, name, mutated_inputs(gm)) if cuda_graphs else gm
    if backend == "inductor":
        log.info("lowering %s with inductor (compiled on its first call per shape)", name)
        # compile the generated forward itself: GraphModule.__call__'s error wrapper walks tracebacks
        # with a generator, which hides the real error of a failed compile under "trace generator"
        options = dict(INDUCTOR_OPTIONS.get(device_type, {}))
        if serial_kernels and device_type == "cpu":
            options.update(SERIAL_KERNELS)
        forward_outside_compiles(gm)
        compiled = compile_with_inductor(gm, options)
        if cuda_graphs:  # inside CompiledStage, which maps compile errors and logs the kernels
            compiled = GraphedStage(compiled, name, mutated_inputs(gm), dynamic_dims=dynamic_dims)
        stage = CompiledStage(gm, compiled, name, dynamic_dims, config_patch,
                              options if device_type == "cpu" and not cuda_graphs else None)
        if compiler is not None and not cuda_graphs:
            return TieredStage(gm if eager_gm is None else eager_gm, stage, name, compiler, stage.written)
        return stage


class CompiledStage:
    """A compiled stage: logs each compilation (on :data:`PROGRESS_LOGGER` when a call brings shapes it
    has not run yet, :func:`~saguaro.lower.tiered.shape_key`) and turns compiler failures into
    ``LoweringError``. ``written``: the positions of the inputs it writes in place (the KV caches).
    ``dynamic_dims``: the dimensions a call with new shapes marks dynamic before it compiles
    (:func:`lower_graph`). ``config_patch``: Inductor settings around a call with new shapes (its compile).
    ``helper_options``: its Inductor options, where a compile helper may compile it too (None: not on CUDA)."""

    graphs_off = property(lambda self: getattr(self.compiled, "graphs_off", None))  # GraphedStage's, if it is one

    def __init__(self, gm: torch.fx.GraphModule, compiled, name: str, dynamic_dims: dict | None = None,
                 config_patch: dict | None = None, helper_options: dict | None = None):
        self.gm, self.compiled, self.name = gm, compiled, name
        self.config_patch = dict(config_patch or {})
        self.helper_options = helper_options
        self.helper_setup: tuple = ()  # "module:function" names the helper calls first (an op library to load)
        self._packed: dict | None = None  # the graph as the compile helper gets it, made once
        self.dynamic_dims = dict(dynamic_dims or {})
        self.calls = 0
        self.compile_s: float | None = None  # the first call, compile included
        self.output_code: list[dict] = []  # what Inductor generated on the first call (kernel_log)
        self.keys: set = set()  # the shape keys it has run
        self.written = frozenset(mutated_inputs(gm))  # the KV caches
        self._positions = KeyPositions(self.written)
        # shape key -> DirectCall or None (dynamo's path), learnt from the key's first call (direct_call.py);
        # off where `compiled` is not dynamo's function itself (CUDA graphs replay it), or with
        # $SAGUARO_DIRECT_CALLS=0
        self.direct_calls = not isinstance(compiled, GraphedStage) and direct_calls_wanted()
        self._direct: dict = {}
        self._held = held_tensors(gm) if self.direct_calls else {}

    def repeated(self, args, varying: int):
        """Later calls like ``self(*args)``, the first ``varying`` arguments changing (``lower/repeated_call.py``)."""
        return repeated_call(self, args, varying)

    @property
    def direct_keys(self) -> int:
        """How many shape keys its calls reach Inductor's function for without dynamo (direct_call.py)."""
        return sum(call is not None for call in self._direct.values())

    @property
    def graph_keys(self) -> int:
        """How many of those call Inductor's graph itself, past AOT autograd's wrapper (direct_call.py)."""
        return sum(call is not None and call.boxed is not None for call in self._direct.values())

    @property
    def helper_serves(self) -> bool:  # see helper_request
        return self.helper_options is not None and not self.config_patch.get("freezing")

    def helper_request(self, args: list, modes: tuple) -> dict | None:
        """The compile helper's request to compile this stage for scratch ``args`` under ``modes`` as this
        stage would (:mod:`~saguaro.lower.compile_helper_main`), or None: not on CPU, or frozen weights
        (``TEMPLATE_GEMM_CONFIG``: Inductor's FX graph cache skips such a graph)."""
        if not self.helper_serves:
            return None
        if self._packed is None:
            from saguaro.lower.graph_transport import pack_graph

            self._packed = pack_graph(self.gm)
        return {"graph": self._packed, "args": args, "modes": modes, "dynamic_dims": self.dynamic_dims,
                "options": self.helper_options, "config_patch": self.config_patch, "setup": self.helper_setup}

    def __call__(self, *args):
        self.calls += 1
        key = self._positions.key(args)
        direct = self._direct.get(key) if self.direct_calls else None
        if direct is not None and direct.applies():
            return direct(args)
        new = key not in self.keys
        if new:
            progress.info("compiling stage %s with inductor", self.name,
                          extra={"compile_event": "start", "stage": self.name, "seconds": 0.0})
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
                progress.info("stage %s did not compile", self.name, extra={
                    "compile_event": "failed", "stage": self.name, "seconds": time.perf_counter() - started})

            if isinstance(exc, (BackendCompilerFailed, TorchRuntimeError, Unsupported)):
                node = responsible_node(self.gm, exc)
                where = f" at FX node {node!r}" if node else ""
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise LoweringError(f"inductor could not compile stage {self.name}{where}: {first}") from exc
            raise
        elapsed = time.perf_counter() - started
        if self.direct_calls and key not in self._direct:
            self._direct[key] = direct_call(calls, args, out, self._held)
            log.debug("stage %s: calls of a new shape key go %s", self.name,
                      "past dynamo" if self._direct[key] else "through dynamo (inputs not rebuilt)")
        if new:
            self.keys.add(key)
            progress.info("stage %s compiled in %.1fs (call %d)", self.name, elapsed, self.calls,
                          extra={"compile_event": "done", "stage": self.name, "seconds": elapsed})
        elif elapsed > COMPILE_LOG_S:  # a recompile the shape key did not foresee
            log.info("stage %s: call %d (compile included) took %.1fs", self.name, self.calls, elapsed)
        return out

