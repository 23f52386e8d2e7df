"""``saguaro.compile``: capture → lower → Program, in the direct or the decorator form."""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading

import torch

from saguaro.artifact.export import export_program
from saguaro.artifact.signature import varying_dims
from saguaro.capture import CapturedModel, capture, model_spec
from saguaro.capture.attention_op import direct_kernel_calls
from saguaro.capture.captured_files import CapturedSource, load_captured
from saguaro.core.config import SaguaroConfig
from saguaro.core.errors import ConfigError, SaguaroError
from saguaro.core.stages import DRAFT_CHAIN, FEW_ROW_FAMILIES, TARGET_VERIFY_ROUND, Stage
from saguaro.lower.compile_helper import helper_wanted
from saguaro.lower.compile_thread import BackgroundCompiler
from saguaro.lower.cuda_graphs import GraphedStage, captures_stage, resolve_cuda_graphs
from saguaro.lower.kernel_choice import attention_implementation, linear_implementation
from saguaro.lower.lowering import TEMPLATE_GEMM_CONFIG, lower_graph, shape_policy
from saguaro.passes import run_pipeline
from saguaro.passes.fuse_projections import fusion_applies
from saguaro.passes.lower_attention import attention_kernel
from saguaro.passes.pipeline import PipelineStages, build_stage, holding_what_it_reads
from saguaro.passes.quantize_weights import QuantizeWeights
from saguaro.runtime.base.kv_store import KVPool
from saguaro.runtime.base.model_runner import ModelRunner
from saguaro.runtime.base.sequences import SequencePool
from saguaro.runtime.draft.server import SpeculationServer
from saguaro.runtime.lanes.draft_files import RemoteDraft
from saguaro.runtime.lanes.remote import RemoteEndpoint
from saguaro.runtime.program import Program
from saguaro.tensor_math.fork import RANK_WIDTH
from saguaro.tensor_math.packed_linear import available as packed_kernel_available

# what a compile helper calls before it compiles a packed graph
PACKED_SETUP = "saguaro.tensor_math.packed_linear:available"

log = logging.getLogger(__name__)


def compile(target=None, draft=None, **config):
    """Compile ``target`` (and ``draft``) into a :class:`~saguaro.runtime.program.Program`.

    ``config``: the fields of :class:`~saguaro.core.config.SaguaroConfig` (``ConfigError`` on a bad one).
    Without ``target``: a decorator taking the target or a zero-argument factory, like ``torch.compile``.
    """
    cfg = SaguaroConfig(**config)
    if target is None:

        def decorator(target_or_factory):
            model = target_or_factory
            if not isinstance(model, torch.nn.Module) and callable(model):
                model = model()
            return compile_program(model, draft, cfg)

        return decorator
    return compile_program(target, draft, cfg)


def compile_program(target, draft, cfg: SaguaroConfig, shard=None) -> Program:
    """Check the pair, capture and lower both models, and build the Program; ``shard``: a target rank's
    ``ShardTensorParallel`` pass. Raises ``SaguaroError`` / ``ValueError`` / ``ConfigError`` on a bad pair."""
    if not isinstance(target, torch.nn.Module):
        raise SaguaroError(f"target must be a Hugging Face causal LM module, got {type(target).__name__}")
    if draft is None and cfg.mode != "ar" and cfg.lane != "remote":
        raise ValueError(f"mode={cfg.mode!r} needs a draft model; pass draft=... or use mode='ar'")
    if draft is not None and not isinstance(draft, torch.nn.Module):
        raise SaguaroError(f"draft must be a Hugging Face causal LM module, got {type(draft).__name__}")
    if cfg.tensor_parallel is not None and shard is None:
        return compile_tensor_parallel(target, draft, cfg)
    target_spec = model_spec(target)
    if draft is not None:
        device = draft_device(cfg.draft_device, target_spec.device)  # checked before anything moves
        check_pair(target_spec, model_spec(draft), another_device=device is not None)
        if device is not None and device != target_spec.device and cfg.lane == "process":
            raise ConfigError(
                f"lane='process' cannot serve draft_device={cfg.draft_device!r}: the draft process "
                f"runs on the target's device ({target_spec.device}); use lane='thread' or 'auto'"
            )
        if device is not None and model_spec(draft).device != device:
            log.info("moving the draft to %s (draft_device=%r)", device, cfg.draft_device)
            draft.to(device)
    endpoint = remote_endpoint(cfg, target_spec, draft) if cfg.lane == "remote" else None
    models = {name: model for name, model in (("target", target), ("draft", draft)) if model is not None}
    graphs = {
        name: resolve_cuda_graphs(cfg.cuda_graphs, model_spec(model).device) for name, model in models.items()
    }
    # compile="background": one compile thread for both models' stages (saguaro.lower.tiered), held until the
    # first round is out (Program.generate releases it), and on a CPU with two cores a compile helper process
    if cfg.backend == "inductor" and cfg.linears in ("auto", "packed") and target_spec.device.type == "cpu":
        threading.Thread(target=packed_kernel_available, name="saguaro-kernel-build", daemon=True).start()
    compiler = None
    if cfg.compile == "background" and cfg.backend == "inductor":
        helper = helper_wanted() and target_spec.device.type == "cpu"
        compiler = BackgroundCompiler(held=True, helper=helper)
        compiler.start_helper()  # it warms Inductor up while the models are captured
    captures = {name: capture(model) for name, model in models.items()}
    # what a draft process starts from: the draft's capture as files (None: its graph has no JSON form, and
    # the draft process rebuilds the model from its class and captures it; or a draft server serves the draft)
    source = CapturedSource.of(captures["draft"]) if draft is not None and endpoint is None else None
    runners = {
        name: build_runner(
            name, captures[name], cfg, graphs[name], shard if name == "target" else None, compiler
        )
        for name in models
    }
    gen = getattr(target, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    pad = getattr(gen, "pad_token_id", None) if gen is not None else None
    if pad is None:
        pad = eos[0] if isinstance(eos, (list, tuple)) and eos else (eos if isinstance(eos, int) else 0)
    remote = endpoint or (
        RemoteDraft(draft, cfg.backend, cfg.attention, source) if draft is not None else None
    )
    configs = {
        name: model.config for name, model in (("target", target), ("draft", draft)) if model is not None
    }
    return Program(
        cfg,
        runners["target"],
        runners.get("draft"),
        pad_token_id=int(pad),
        eos_token_id=eos,
        shapes=shape_policy(cfg.backend, target_spec.device.type),
        remote_draft=remote,
        exporter=functools.partial(export_program, model_configs=configs),
    )


def build_runner(
    name: str,
    model: torch.nn.Module | CapturedModel,
    config: SaguaroConfig,
    cuda_graphs: bool = False,
    shard=None,
    compiler: BackgroundCompiler | None = None,
) -> ModelRunner:
    """The runner of ``model`` (captured here unless given as a capture) after the base pass pipeline.

    ``config``: backend, attention, linears, narrow weights and ``name``'s quantization. ``cuda_graphs``
    (resolved): fixed-shape stages replay graphs over pooled KV stores and sequences. ``shard``: a
    ``ShardTensorParallel`` pass after the pipeline (the spec becomes the rank's). ``compiler``: the
    background compile thread, or None."""
    captured = model if isinstance(model, CapturedModel) else capture(model)
    quantized = config.quantized(name)
    extra = ((shard,) if shard is not None else ()) + ((QuantizeWeights(*quantized),) if quantized else ())
    captured.graph_module = run_pipeline(captured.graph_module, extra)
    if shard is not None:
        captured.spec = shard.local_spec
    width = min(captured.spec.vocab_size, RANK_WIDTH)  # fork / rank / Saguaro-sampling width
    builder = CompiledStages(
        name,
        captured.graph_module,
        width,
        config.backend,
        config.attention,
        captured.spec.device.type,
        cuda_graphs,
        compiler,
        config.linears,
        config.narrow_weights,
    )
    # CUDA graphs: KV stores and sequence buffers at fixed addresses, generation after generation
    return ModelRunner(
        name,
        captured,
        builder,
        width,
        kv_pool=KVPool() if cuda_graphs else None,
        seq_pool=SequencePool() if cuda_graphs else None,
    )


class CompiledStages(PipelineStages):
    """The :class:`~saguaro.runtime.base.model_runner.StageBuilder` of a compiled model: called on a stage's
    first use, it derives the stage graph by the stage pipeline and lowers it for the backend. ``compiler``:
    the thread compiling stages while they run eager (:mod:`saguaro.lower.tiered`), or None."""

    def __init__(
        self,
        model_name: str,
        graph_module: torch.fx.GraphModule,
        width: int,
        backend: str,
        attention: str,
        device_type: str,
        cuda_graphs: bool = False,
        compiler: BackgroundCompiler | None = None,
        linears: str = "auto",
        narrow_weights: bool = True,
        fuse_projections: bool | None = None,
    ):
        super().__init__(graph_module, width, attention_implementation(backend, attention))
        self.model_name = model_name
        self.backend = backend
        self.device_type = device_type
        self.requested_attention = attention
        self.cuda_graphs = cuda_graphs
        self.compiler = compiler
        self.requested_linears = linears
        self.narrow_weights = narrow_weights
        self.fuse_projections = fuse_projections  # fusion_applies's `requested`

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """True once no background compile is queued or running; False after ``timeout`` seconds."""
        return True if self.compiler is None else self.compiler.wait(timeout)

    def first_tokens_out(self) -> None:
        """The first generation's first round is out: the held compiler may start (``BackgroundCompiler``)."""
        if self.compiler is not None:
            self.compiler.release()

    def stop_compiling(self) -> None:
        """Drop the queued background compiles and stop the thread (a later stage call starts it again)."""
        if self.compiler is not None:
            self.compiler.close()

    def compile_blocking(self) -> None:
        """Build later stages without the background compiler: compiled on their first call, blocking."""
        self.stop_compiling()
        self.compiler = None

    def provides(self, stage: Stage) -> bool:
        """False for SD's round stages under CUDA graphs, where the round is ``sd_graph.py``'s graph."""
        return not (self.cuda_graphs and stage in (TARGET_VERIFY_ROUND, DRAFT_CHAIN))

    def graphed(self, fn, name: str, fixed):
        """Under CUDA graphs, ``fn`` (SD's round) as one graph per signature; else None."""
        return GraphedStage(fn, name, fixed, encloses=True) if self.cuda_graphs else None

    def stage_graph(self, stage: Stage, observe=None, linears: str | None = None):
        """The stage's graph: attention lowered, linears as :meth:`linears_of` says (template: GEMMs)."""
        built = self.device_type == "cpu" and packed_kernel_available()  # the saguaro_kernels library
        attention = attention_implementation(
            self.backend,
            self.requested_attention,
            self.device_type,
            stage.mask,
            stage=stage,
            kernel_built=built,
        )
        if attention == "kernel" and not built:  # asked for, no compiler here
            attention = "inline"
        linears = self.linears_of(stage, linears)
        if linears == "template":  # its graph keeps the GEMMs: only its compile settings differ
            linears = "gemm"
        # narrow weights where reads fuse into Inductor's kernels (a BLAS call would copy them widened each
        # call): the reductions', the packed stages' other reads (the embedding); packed panels widen in
        # registers
        narrow = self.narrow_weights and self.backend == "inductor" and linears in ("reduction", "packed")
        fuse = fusion_applies(self.backend, self.device_type, linears, self.fuse_projections)
        return build_stage(
            self.graph_module,
            stage,
            self.width,
            attention=attention,
            observe=observe,
            linears=linears,
            narrow=narrow,
            fuse=fuse,
            narrow_panels=self.narrow_weights,
        )

    def linears_of(self, stage: Stage, linears: str | None = None) -> str:
        """How ``stage``'s linears run: ``linears``, else the choice for stage and device; never unbuilt."""
        linears = linears or linear_implementation(
            self.backend, self.requested_linears, self.device_type, stage.family
        )
        unbuilt = linears == "packed" and not packed_kernel_available()  # no compiler here
        return ("reduction" if self.backend == "inductor" else "gemm") if unbuilt else linears

    def __call__(self, stage: Stage, linears: str | None = None):
        """The lowered stage (``linears``: as :meth:`linears_of`'s)."""
        linears = self.linears_of(stage, linears)
        gm = self.stage_graph(stage, linears=linears)
        # what runs eager during a background compile: BLAS linears (an eager product is slow)
        eager_gm = None
        if self.compiler is not None and linears == "reduction":
            eager_gm = self.stage_graph(stage, linears="gemm")
        if self.backend == "eager":  # "kernel" attention: no op, the module kept
            gm = holding_what_it_reads(direct_kernel_calls(gm))
        inputs = sum(1 for node in gm.graph.nodes if node.op == "placeholder")
        # Inductor compiles dynamic at once
        varying = varying_dims(stage, inputs) if self.backend == "inductor" else None
        lowered = lower_graph(
            gm,
            self.backend,
            stage.qualified,
            self.device_type,
            cuda_graphs=self.cuda_graphs and captures_stage(stage),
            compiler=self.compiler,
            dynamic_dims=varying,
            eager_gm=eager_gm,
            config_patch=TEMPLATE_GEMM_CONFIG if linears == "template" else None,
            serial_kernels=linears == "packed" and stage.family in FEW_ROW_FAMILIES,  # not T rows
        )
        inner = getattr(lowered, "compiled", lowered)  # a tiered stage's CompiledStage
        kernel_attention = any(node.target is attention_kernel for node in gm.graph.nodes)
        if hasattr(inner, "helper_setup") and (linears == "packed" or kernel_attention):
            inner.helper_setup = (PACKED_SETUP,)  # the compile helper loads the kernel's library first
        return lowered


def compile_tensor_parallel(target, draft, cfg: SaguaroConfig):
    """``tensor_parallel=N``: on target rank ``r < N`` the Program over shard ``r`` (the draft replicated for
    SD), on rank ``N`` the draft rank's program. Indivisible head counts raise before any collective."""
    from saguaro.passes.shard_tensor_parallel import Shard, ShardTensorParallel, check_divisible
    from saguaro.runtime.tensor_parallel import DraftRankProgram, TensorParallelProgram, join_ranks

    spec = model_spec(target)
    check_divisible(spec, cfg.tensor_parallel)
    ranks = join_ranks(cfg.tensor_parallel, spec.device)
    if ranks.is_draft:

        def make_server():
            return SpeculationServer(build_runner("draft", draft, cfg), cfg)

        return DraftRankProgram(cfg, ranks, make_server, spec.vocab_size)
    shard = ShardTensorParallel(spec, Shard(ranks.rank, cfg.tensor_parallel, ranks.target_group.group_name))
    # SSD's rounds always: choosing SD by measured time would need the ranks to agree on one measurement; no
    # CUDA graphs unless asked (cuda_graphs=True): the all-reduces inside captured graphs have not run on GPUs
    target_cfg = dataclasses.replace(
        cfg, sd_when_faster=False, cuda_graphs=False if cfg.cuda_graphs == "auto" else cfg.cuda_graphs
    )
    return TensorParallelProgram(compile_program(target, draft, target_cfg, shard), ranks)


def remote_endpoint(cfg: SaguaroConfig, target_spec, draft) -> RemoteEndpoint:
    """``lane="remote"``: the endpoint of a draft server checked against the target (vocabulary, dtype, ``k``:
    ``ConfigError`` naming both); a server that cannot be reached raises."""
    if draft is None and cfg.mode == "sd":
        raise ConfigError(
            f"mode='sd' needs a local draft, and draft=None: the draft is the server at "
            f"{cfg.draft_address}; use mode='ssd' (exact AR when the server cannot serve), or pass "
            "draft=... as well"
        )
    endpoint = RemoteEndpoint(cfg, target_spec)
    endpoint.probe(cfg.lane_start_timeout_s)
    return endpoint


def check_pair(target_spec, draft_spec, another_device: bool = False) -> None:
    """``ValueError`` when target and draft differ in vocabulary or dtype, or in device (unless
    ``another_device``: ``draft_device`` placed the draft)."""
    if target_spec.vocab_size != draft_spec.vocab_size:
        raise ValueError(
            f"vocabulary mismatch: target {target_spec.model_class} has {target_spec.vocab_size} tokens, "
            f"draft {draft_spec.model_class} has {draft_spec.vocab_size}; target and draft must share one "
            "vocabulary"
        )
    if target_spec.device != draft_spec.device and not another_device:
        raise ValueError(
            f"draft is on device {draft_spec.device} but the target is on {target_spec.device}; "
            "put both on the same device, or (CUDA) name the draft's with draft_device="
        )
    if target_spec.dtype != draft_spec.dtype:
        raise ValueError(
            f"draft dtype {draft_spec.dtype} differs from the target's {target_spec.dtype}; "
            "load both in the same dtype"
        )


def draft_device(requested: str | None, target_device: torch.device) -> torch.device | None:
    """Where ``draft_device=requested`` puts the draft of a target on ``target_device`` (None: not given).

    A CPU target's draft stays on the CPU, a CUDA target's goes to any CUDA device this process sees; anything
    else is a ``ConfigError`` naming the value and what is allowed."""
    if requested is None:
        return None
    device = torch.device(requested)
    if target_device.type != "cuda":
        if device.type != target_device.type:
            why = "" if torch.cuda.is_available() else "; this machine has no CUDA device"
            raise ConfigError(
                f"draft_device={requested!r} is not allowed: the target is on {target_device}, and a "
                f"draft on another device needs a CUDA target; use draft_device=None or "
                f"{str(target_device)!r}{why}"
            )
        return target_device
    count = torch.cuda.device_count()
    index = device.index if device.index is not None or device.type != "cuda" else torch.cuda.current_device()
    if device.type != "cuda" or index >= count:
        raise ConfigError(
            f"draft_device={requested!r} is not allowed: the target is on {target_device}, so the "
            f"draft runs on a CUDA device of this process: 'cuda:0'..'cuda:{count - 1}'"
        )
    return torch.device("cuda", index)


def captured_draft_server(description: dict, config: SaguaroConfig) -> SpeculationServer:
    """In a draft process: the speculation server over the capture ``CapturedSource.save`` wrote."""
    captured = load_captured(description, torch.device(description["device"]))
    graphs = resolve_cuda_graphs(config.cuda_graphs, captured.spec.device)
    runner = build_runner("draft", captured, process_draft_config(config), graphs)
    return SpeculationServer(runner, config)


def draft_server(description: dict, config: SaguaroConfig) -> SpeculationServer:
    """In a draft process: the speculation server over the draft rebuilt from ``RemoteDraft.save``'s files."""
    from saguaro.runtime.lanes.draft_files import load_draft

    model = load_draft(description)
    graphs = resolve_cuda_graphs(config.cuda_graphs, next(model.parameters()).device)
    runner = build_runner("draft", model, process_draft_config(config), graphs)
    return SpeculationServer(runner, config)


def process_draft_config(config: SaguaroConfig) -> SaguaroConfig:
    """The config a process lane's draft is built with: the caller's, ``linears`` left at ``"auto"``."""
    return dataclasses.replace(config, linears="auto")
