"""The ordered pass pipelines: the base pipeline every captured graph goes through once, and the
stage pipeline that derives each stage's graph (of :mod:`saguaro.core.stages`) from it. Both run
through :class:`~saguaro.passes.base.graph_pass.PassManager`, which checks each pass's declared
requirements against what the passes before it guarantee (the base graph's record carries over to
every stage graph), so a pipeline in the wrong order fails before its first pass with the pass's
name. :class:`PipelineStages` is the stage pipeline over one captured model, which the stage
builders of ``saguaro.compile`` and the exporter share."""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch._logging import trace_structured

from saguaro.capture.attention_op import MASK_OP
from saguaro.core.stages import Stage
from saguaro.passes.flatten_signature import FlattenSignature
from saguaro.passes.fuse_projections import FuseProjections
from saguaro.passes.base.graph_pass import GraphPass, PassManager, copy_graph, settle_code
from saguaro.passes.base.graph_splice import drop_unread_attributes
from saguaro.passes.last_row_head import LastRowHead
from saguaro.passes.linear_as_reduction import LinearAsReduction
from saguaro.passes.lower_attention import LowerAttention
from saguaro.passes.narrow_weights import NarrowWeights
from saguaro.passes.pack_linears import PackLinears
from saguaro.passes.specialize_attention import SpecializeAttention
from saguaro.passes.splice_epilogue import SpliceEpilogue
from saguaro.passes.strip_runtime_checks import StripRuntimeChecks

log = logging.getLogger(__name__)

# Neither base pass requires the other's guarantee; cleanup runs first so that flatten_signature and
# every stage pass see the smaller graph. The stage passes need flat_signature (they append inputs
# and outputs).
PIPELINE: tuple[GraphPass, ...] = (StripRuntimeChecks(), FlattenSignature())


def run_pipeline(gm: torch.fx.GraphModule, extra: tuple[GraphPass, ...] = ()) -> torch.fx.GraphModule:
    """Apply every pass of :data:`PIPELINE` in order to a captured graph, then ``extra`` (a tensor-parallel
    rank's ``shard_tensor_parallel``: it needs the base pipeline's facts, and every stage graph is
    copied from its result, so the model is sharded once)."""
    return PassManager(PIPELINE + tuple(extra)).run(gm)


def stage_passes(stage: Stage, width: int, attention: str, window: int, linears: str = "gemm",
                 narrow: bool = False, fuse: bool = False, narrow_panels: bool = False) -> list[GraphPass]:
    """The stage pipeline of ``stage``, in order.

    The mask specialisation and the epilogue splice touch different nodes (either order gives the same
    graph); ``last_row_head`` then trims the LM head to the last row where the epilogue reads only that row;
    attention is lowered after them (it requires both), so that it sees the final graph, whose
    attention nodes all read one mask. With ``fuse`` the ``fuse_projections`` pass then joins the linears
    that read one input (it touches no node the others read), before ``linear_as_reduction`` (it joins
    ``aten.linear`` nodes, which that pass replaces; it refuses to run after it). With
    ``linears="reduction"`` the ``linear_as_reduction`` pass then rewrites the linear layers, the joined
    ones included, or with ``"packed"`` the ``pack_linears`` pass (its panels narrow with
    ``narrow_panels``); with ``narrow`` the ``narrow_weights`` pass last replaces the weight reads (every other
    pass sees the float32 weights, except the joined ones, which ``fuse_projections`` keeps narrow itself
    when ``narrow``: narrow_weights leaves a read that is not float32 as it is).
    """
    passes = [SpecializeAttention(stage.mask), SpliceEpilogue(stage, width), LastRowHead(),
              LowerAttention(attention, window=window)]
    if fuse:
        passes.append(FuseProjections(narrow))
    if linears == "reduction":
        passes.append(LinearAsReduction())
    elif linears == "packed":
        passes.append(PackLinears(narrow_panels))
    return passes + [NarrowWeights()] if narrow else passes


def build_stage(base: torch.fx.GraphModule, stage: Stage, width: int, attention: str = "op",
                observe: Callable[[str, torch.fx.GraphModule], None] | None = None,
                linears: str = "gemm", narrow: bool = False, fuse: bool = False,
                narrow_panels: bool = False) -> torch.fx.GraphModule:
    """The graph of ``stage``: a copy of the base graph (sharing its parameters, carrying its pass
    record) through the stage pipeline. ``attention`` is how ``lower_attention`` lowers attention
    (``"op"``, ``"inline"`` or ``"flex"``); ``linears`` how the linear layers run (``"gemm"`` as
    captured, ``"reduction"``: the ``linear_as_reduction`` pass, ``"packed"``: ``pack_linears``, its panels
    narrow with ``narrow_panels``); ``narrow``: the ``narrow_weights`` pass; ``fuse``: the
    ``fuse_projections`` pass. ``observe(pass_name, gm)``, when given, sees the graph before the first pass
    (name ``"captured"``) and after each pass."""
    manager = PassManager(stage_passes(stage, width, attention, _sliding_window(base), linears, narrow, fuse,
                                       narrow_panels))
    gm = copy_graph(base)
    if observe is not None:
        observe("captured", gm)
    gm = settle_code(manager.run(gm, observe))
    log.info("stage %s: %d nodes", stage.qualified, len(gm.graph.nodes))
    if structured_trace_on():  # the stage graph beside Inductor's own artifacts in TORCH_TRACE (tlparse)
        trace_structured("artifact", metadata_fn=lambda: {"name": f"saguaro_stage_{stage.qualified}",
                                                          "encoding": "string"},
                         payload_fn=lambda: gm.print_readable(print_output=False, include_stride=True,
                                                              include_device=True), expect_trace_id=False)
    return gm


def holding_what_it_reads(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with every parameter and buffer its graph does not read deleted from it (its own submodules' paths;
    the model keeps them), as a module made over its graph would hold: an eager stage whose attention was lowered
    away from the ops (``"kernel"``) is the stage module itself, and holds no more than one with them."""
    drop_unread_attributes(gm, [name for name, _ in (*gm.named_parameters(), *gm.named_buffers())])
    return gm


def structured_trace_on() -> bool:
    """Whether torch's structured trace writes anywhere: TORCH_TRACE gave its handler a folder, or a
    handler of someone's own was added. torch installs a handler without a folder in every process,
    which writes nothing in its open-source build, and ``trace_structured`` computes the payload
    whenever a handler is there: the verbose text of each stage graph (importing
    ``torch.distributed.tensor`` on the first, about 2 s in a fresh process)."""
    from torch._logging._internal import LazyTraceHandler, trace_log

    return any(not isinstance(h, LazyTraceHandler) or h.root_dir is not None for h in trace_log.handlers)


class PipelineStages:
    """Stage graphs of one captured model: ``graph_module`` (after :data:`PIPELINE`) through the stage
    pipeline, with rank width ``width`` and attention lowered to ``attention``. Subclasses add
    ``__call__(stage)``, the runnable stage a :class:`~saguaro.runtime.base.model_runner.ModelRunner`
    asks for."""

    def __init__(self, graph_module: torch.fx.GraphModule, width: int, attention: str):
        self.graph_module, self.width, self.attention = graph_module, width, attention

    def stage_graph(self, stage: Stage, observe: Callable[[str, torch.fx.GraphModule], None] | None = None):
        """The graph of ``stage`` after every pass; ``observe`` as for :func:`build_stage`."""
        return build_stage(self.graph_module, stage, self.width, attention=self.attention, observe=observe)


def _sliding_window(base: torch.fx.GraphModule) -> int:
    """The window the captured model's generic mask node was built with (0: none)."""
    node = next((n for n in base.graph.nodes if n.op == "call_function" and n.target is MASK_OP), None)
    return int(node.args[6]) if node is not None else 0
