"""``saguaro.compile``: capture → lower → Program, in the direct or the decorator form."""

from __future__ import annotations

import functools
import logging

import torch

from saguaro.artifact.export import export_program
from saguaro.capture import capture, model_spec
from saguaro.core.config import SaguaroConfig
from saguaro.core.errors import SaguaroError
from saguaro.core.stages import Stage
from saguaro.lower.lowering import attention_implementation, lower_graph, shape_policy
from saguaro.passes import run_pipeline
from saguaro.passes.pipeline import PipelineStages
from saguaro.runtime.lanes.draft_files import RemoteDraft
from saguaro.runtime.draft.server import SpeculationServer
from saguaro.runtime.base.model_runner import ModelRunner
from saguaro.runtime.program import Program
from saguaro.tensor_math.fork import RANK_WIDTH

log = logging.getLogger(__name__)


def compile(target=None, draft=None, **config):  # noqa: A001 - mirrors torch.compile
    """Compile ``target`` (and ``draft``) into a :class:`~saguaro.runtime.program.Program`.

    ``saguaro.compile(target, draft, k=5, mode="sd", backend="eager")`` returns a Program.
    Without a target, ``saguaro.compile(draft=d, **cfg)`` returns a decorator that takes the target
    (a module, or a zero-argument function returning one), like ``torch.compile``.
    Options are the fields of :class:`saguaro.core.config.SaguaroConfig`.
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


def compile_program(target, draft, cfg: SaguaroConfig) -> Program:
    """Check the pair, capture both models, lower them, and build the Program."""
    if not isinstance(target, torch.nn.Module):
        raise SaguaroError(f"target must be a Hugging Face causal LM module, got {type(target).__name__}")
    if draft is None and cfg.mode != "ar":
        raise ValueError(f"mode={cfg.mode!r} needs a draft model; pass draft=... or use mode='ar'")
    if draft is not None and not isinstance(draft, torch.nn.Module):
        raise SaguaroError(f"draft must be a Hugging Face causal LM module, got {type(draft).__name__}")
    target_spec = model_spec(target)
    if draft is not None:
        check_pair(target_spec, model_spec(draft))
    runners = {name: build_runner(name, model, cfg.backend, cfg.attention)
               for name, model in (("target", target), ("draft", draft)) if model is not None}
    gen = getattr(target, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    pad = getattr(gen, "pad_token_id", None) if gen is not None else None
    if pad is None:
        pad = eos[0] if isinstance(eos, (list, tuple)) and eos else (eos if isinstance(eos, int) else 0)
    remote = RemoteDraft(draft, cfg.backend, cfg.attention) if draft is not None else None
    configs = {name: model.config for name, model in (("target", target), ("draft", draft)) if model is not None}
    return Program(cfg, runners["target"], runners.get("draft"), pad_token_id=int(pad), eos_token_id=eos,
                   shapes=shape_policy(cfg.backend), remote_draft=remote,
                   exporter=functools.partial(export_program, model_configs=configs))


def build_runner(name: str, model: torch.nn.Module, backend: str, attention: str = "auto") -> ModelRunner:
    """Capture ``model``, run the base pass pipeline, and wrap it with the builder of its stages."""
    captured = capture(model)
    captured.graph_module = run_pipeline(captured.graph_module)
    width = min(captured.spec.vocab_size, RANK_WIDTH)  # fork / rank / Saguaro-sampling width
    builder = CompiledStages(name, captured.graph_module, width, backend, attention, captured.spec.device.type)
    return ModelRunner(name, captured, builder, width)


class CompiledStages(PipelineStages):
    """The :class:`~saguaro.runtime.base.model_runner.StageBuilder` of a compiled model: each stage graph
    derived from the captured graph by the stage pass pipeline, then lowered for the backend; the
    runtime calls it on a stage's first use."""

    def __init__(self, model_name: str, graph_module: torch.fx.GraphModule, width: int, backend: str,
                 attention: str, device_type: str):
        super().__init__(graph_module, width, attention_implementation(backend, attention))
        self.model_name, self.backend, self.device_type = model_name, backend, device_type

    def __call__(self, stage: Stage):
        return lower_graph(self.stage_graph(stage), self.backend, stage.qualified, self.device_type)


def check_pair(target_spec, draft_spec) -> None:
    """Target and draft must share the vocabulary, the device and the dtype."""
    if target_spec.vocab_size != draft_spec.vocab_size:
        raise ValueError(
            f"vocabulary mismatch: target {target_spec.model_class} has {target_spec.vocab_size} tokens, draft "
            f"{draft_spec.model_class} has {draft_spec.vocab_size}; target and draft must share one vocabulary")
    if target_spec.device != draft_spec.device:
        raise ValueError(f"draft is on device {draft_spec.device} but the target is on {target_spec.device}; "
                         "put both on the same device")
    if target_spec.dtype != draft_spec.dtype:
        raise ValueError(f"draft dtype {draft_spec.dtype} differs from the target's {target_spec.dtype}; "
                         "load both in the same dtype")


def draft_server(description: dict, config: SaguaroConfig) -> SpeculationServer:
    """In a process lane's draft process: the draft rebuilt from the files ``RemoteDraft.save`` wrote,
    captured, and its speculation server."""
    from saguaro.runtime.lanes.draft_files import load_draft

    runner = build_runner("draft", load_draft(description), description["backend"], description["attention"])
    return SpeculationServer(runner, config)
