"""The pass pipelines: :data:`PIPELINE` once per captured graph, :func:`stage_passes` per stage, each run
by a :class:`~saguaro.passes.base.graph_pass.PassManager` (out of order: ``PassError`` before any pass)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch._logging import trace_structured

from saguaro.capture.attention_op import MASK_OP
from saguaro.core.stages import Stage
from saguaro.passes.base.graph_pass import GraphPass, PassManager, copy_graph, settle_code
from saguaro.passes.base.graph_splice import drop_unread_attributes
from saguaro.passes.flatten_signature import FlattenSignature
from saguaro.passes.fuse_projections import FuseProjections
from saguaro.passes.last_row_head import LastRowHead
from saguaro.passes.linear_as_reduction import LinearAsReduction
from saguaro.passes.lower_attention import LowerAttention
from saguaro.passes.narrow_weights import NarrowWeights
from saguaro.passes.pack_linears import PackLinears
from saguaro.passes.specialize_attention import SpecializeAttention
from saguaro.passes.splice_epilogue import SpliceEpilogue
from saguaro.passes.strip_runtime_checks import StripRuntimeChecks

log = logging.getLogger(__name__)

# cleanup first, so flatten_signature and every stage pass see the smaller graph
PIPELINE: tuple[GraphPass, ...] = (StripRuntimeChecks(), FlattenSignature())


def run_pipeline(gm: torch.fx.GraphModule, extra: tuple[GraphPass, ...] = ()) -> torch.fx.GraphModule:
    """``gm`` through :data:`PIPELINE`, then ``extra`` (a rank's ``shard_tensor_parallel``: sharded once)."""
    return PassManager(PIPELINE + tuple(extra)).run(gm)


def stage_passes(
    stage: Stage,
    width: int,
    attention: str,
    window: int,
    linears: str = "gemm",
    narrow: bool = False,
    fuse: bool = False,
    narrow_panels: bool = False,
) -> list[GraphPass]:
    """The stage pipeline of ``stage``: mask, epilogue, last-row head, attention; then ``fuse_projections``
    (``fuse``), the linears' rewrite of ``linears`` (``"reduction"``, ``"packed"``: panels narrow with
    ``narrow_panels``) and, with ``narrow``, ``narrow_weights`` last."""
    passes = [
        SpecializeAttention(stage.mask),
        SpliceEpilogue(stage, width),
        LastRowHead(),
        LowerAttention(attention, window=window),
    ]
    if fuse:
        passes.append(FuseProjections(narrow))
    if linears == "reduction":
        passes.append(LinearAsReduction())
    elif linears == "packed":
        passes.append(PackLinears(narrow_panels))
    return passes + [NarrowWeights()] if narrow else passes


def build_stage(
    base: torch.fx.GraphModule,
    stage: Stage,
    width: int,
    attention: str = "op",
    observe: Callable[[str, torch.fx.GraphModule], None] | None = None,
    linears: str = "gemm",
    narrow: bool = False,
    fuse: bool = False,
    narrow_panels: bool = False,
) -> torch.fx.GraphModule:
    """The graph of ``stage``: a copy of ``base`` (its parameters shared) through :func:`stage_passes`;
    ``observe(pass name, gm)`` sees it first as ``"captured"``, then after each pass."""
    manager = PassManager(
        stage_passes(stage, width, attention, _sliding_window(base), linears, narrow, fuse, narrow_panels)
    )
    gm = copy_graph(base)
    if observe is not None:
        observe("captured", gm)
    gm = settle_code(manager.run(gm, observe))
    log.info("stage %s: %d nodes", stage.qualified, len(gm.graph.nodes))
    if structured_trace_on():  # the stage graph beside Inductor's own artifacts in TORCH_TRACE (tlparse)
        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": f"saguaro_stage_{stage.qualified}", "encoding": "string"},
            payload_fn=lambda: gm.print_readable(
                print_output=False, include_stride=True, include_device=True
            ),
            expect_trace_id=False,
        )
    return gm


def holding_what_it_reads(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` with every parameter and buffer its graph does not read deleted (the model keeps them)."""
    drop_unread_attributes(gm, [name for name, _ in (*gm.named_parameters(), *gm.named_buffers())])
    return gm


def structured_trace_on() -> bool:
    """Whether torch's structured trace writes anywhere (its payload, a stage graph's text, is costly)."""
    from torch._logging._internal import LazyTraceHandler, trace_log

    return any(not isinstance(h, LazyTraceHandler) or h.root_dir is not None for h in trace_log.handlers)


class PipelineStages:
    """Stage graphs of one captured model at rank width ``width``; subclasses add ``__call__(stage)``."""

    def __init__(self, graph_module: torch.fx.GraphModule, width: int, attention: str):
        self.graph_module, self.width, self.attention = graph_module, width, attention

    def stage_graph(self, stage: Stage, observe: Callable[[str, torch.fx.GraphModule], None] | None = None):
        """The graph of ``stage`` after every pass; ``observe`` as for :func:`build_stage`."""
        return build_stage(self.graph_module, stage, self.width, attention=self.attention, observe=observe)


def _sliding_window(base: torch.fx.GraphModule) -> int:
    """The window the captured model's generic mask node was built with (0: none)."""
    node = next((n for n in base.graph.nodes if n.op == "call_function" and n.target is MASK_OP), None)
    return int(node.args[6]) if node is not None else 0
