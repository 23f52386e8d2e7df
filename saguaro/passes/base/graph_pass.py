"""Passes with contracts, as ``torch.fx.passes.infra``'s ``PassBase`` / ``PassManager``, over named facts.

A :class:`GraphPass` declares the :data:`FACTS` it ``requires``, ``guarantees`` and ``invalidates``; a graph
carries its :class:`PassRecord` in ``gm.meta[RECORD_KEY]`` (none: :data:`CAPTURED`). A missing fact is a
``PassError`` naming pass and fact, raised before the graph is touched (by :class:`PassManager`, before the
first pass)."""

from __future__ import annotations

import abc
import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.fx._lazy_graph_module import _LazyGraphModule

from saguaro.passes.base.graph_splice import PassError

# The facts, what each means of a graph, and who establishes it.
GENERIC_MASK = "generic_mask"
LOGITS_OUTPUT = "logits_output"
NO_RUNTIME_CHECKS = "no_runtime_checks"
FLAT_SIGNATURE = "flat_signature"
STAGE_MASK = "stage_mask"
EPILOGUE_SPLICED = "epilogue_spliced"
ATTENTION_LOWERED = "attention_lowered"
TENSOR_PARALLEL = "tensor_parallel"
LINEARS_AS_REDUCTIONS = "linears_as_reductions"
WEIGHTS_NARROWED = "weights_narrowed"
PROJECTIONS_FUSED = "projections_fused"
LINEARS_PACKED = "linears_packed"
HEAD_LAST_ROW = "head_last_row"
WEIGHTS_QUANTIZED = "weights_quantized"
FACTS = {
    GENERIC_MASK: "one saguaro::attention_mask node per layer kind (capture)",
    LOGITS_OUTPUT: "the logits [B, T, V] are the graph's only output (capture)",
    NO_RUNTIME_CHECKS: "no metadata assertions or no-op dtype conversions (strip_runtime_checks)",
    FLAT_SIGNATURE: "flat positional inputs, a tuple of outputs (flatten_signature)",
    STAGE_MASK: "each mask built by the stage kind's own construction (specialize_attention)",
    EPILOGUE_SPLICED: "the stage's epilogue follows the logits; its results are the outputs (splice_epilogue)",
    ATTENTION_LOWERED: "attention nodes in the form the backend runs (lower_attention)",
    TENSOR_PARALLEL: "a rank's slice of each projection, an all-reduce per row-parallel one (shard_tensor_parallel)",
    PROJECTIONS_FUSED: "linears of one input joined into one over their weights stacked, sliced back (fuse_projections)",
    LINEARS_AS_REDUCTIONS: "each linear a product and a sum reading its weight once for all rows (linear_as_reduction)",
    WEIGHTS_NARROWED: "float32 weights exactly float16 / bfloat16 stored so, widened where read (narrow_weights)",
    LINEARS_PACKED: "each linear the packed few-row kernel over its weight's panels, narrow where exact (pack_linears)",
    HEAD_LAST_ROW: "the LM head over the last row alone where only its logits are read (last_row_head)",
    WEIGHTS_QUANTIZED: "each linear's weight int8 / int4 panels, read by saguaro::quantized_linear (quantize_weights)",
}

RECORD_KEY = "saguaro_pass_record"


@dataclass(frozen=True)
class PassRecord:
    """The facts established, the passes run in order, and ``(fact, pass)`` for each fact invalidated."""

    facts: frozenset
    ran: tuple = ()
    invalidated: tuple = ()

    def after(self, graph_pass: GraphPass) -> PassRecord:
        dropped = tuple((f, graph_pass.name) for f in sorted(graph_pass.invalidates & self.facts))
        kept = tuple((f, by) for f, by in self.invalidated if f not in graph_pass.guarantees)
        return PassRecord(
            (self.facts - graph_pass.invalidates) | graph_pass.guarantees,
            self.ran + (graph_pass.name,),
            kept + dropped,
        )


CAPTURED = PassRecord(frozenset({GENERIC_MASK, LOGITS_OUTPUT}))  # what saguaro.capture's graph holds


def record_of(gm: torch.fx.GraphModule) -> PassRecord:
    """The graph's record; :data:`CAPTURED` for a graph without one."""
    return gm.meta.get(RECORD_KEY, CAPTURED)


def copy_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A lazy GraphModule sharing ``gm``'s parameters, with a copy of its graph and its record; its code is
    generated once, when read (:func:`settle_code` before ``torch.compile``), not on every ``recompile()``."""
    new = _LazyGraphModule(gm, copy.deepcopy(gm.graph))
    new.meta[RECORD_KEY] = record_of(gm)
    return new


def settle_code(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Generate ``gm``'s code now if a pass left it stale (:func:`copy_graph`); returns ``gm``."""
    if isinstance(gm, _LazyGraphModule):
        gm.real_recompile()
    return gm


class GraphPass(abc.ABC):
    """A pass: ``run(gm) -> gm`` rewrites; calling it checks ``requires`` against the record, then records it.
    A subclass without ``name``, a guarantee and ``requires`` (or ``requires_nothing_because``), or naming
    an unknown fact, is a ``TypeError``."""

    name: ClassVar[str]
    requires: ClassVar[frozenset]
    guarantees: ClassVar[frozenset]
    invalidates: ClassVar[frozenset] = frozenset()
    requires_nothing_because: ClassVar[str] = ""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        declared = (
            getattr(cls, "name", None),
            getattr(cls, "requires", None),
            getattr(cls, "guarantees", None),
        )
        if None in declared or not cls.guarantees or not (cls.requires or cls.requires_nothing_because):
            raise TypeError(
                f"pass class {cls.__name__}: declare name, guarantees (at least one fact) and requires "
                "(or requires_nothing_because)"
            )
        unknown = (cls.requires | cls.guarantees | cls.invalidates) - set(FACTS)
        if unknown:
            raise TypeError(
                f"pass {cls.name}: unknown facts {sorted(unknown)}; the facts are {', '.join(FACTS)}"
            )

    @abc.abstractmethod
    def run(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        """The rewrite itself."""

    def check(self, record: PassRecord) -> None:
        """Raise a :class:`PassError` naming this pass and each required fact ``record`` lacks."""
        missing = sorted(self.requires - record.facts)
        if not missing:
            return
        by = dict(record.invalidated)
        reasons = [
            f"{fact}, which {by[fact]} invalidated"
            if fact in by
            else f"{fact}, which no earlier pass guarantees"
            for fact in missing
        ]
        raise PassError(
            f"{self.name} requires {'; and '.join(reasons)} (passes before it: "
            f"{', '.join(record.ran) or 'none'})"
        )

    def __call__(self, gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        record = record_of(gm)
        self.check(record)
        gm = self.run(gm)
        gm.meta[RECORD_KEY] = record.after(self)
        return gm

    def __repr__(self) -> str:
        return self.name


class PassManager:
    """Runs passes in order, the whole sequence checked against the graph's record first."""

    def __init__(self, passes: Iterable[GraphPass]):
        self.passes = tuple(passes)

    def check(self, record: PassRecord) -> PassRecord:
        """Check each pass against the facts the earlier ones leave; returns the final record."""
        for graph_pass in self.passes:
            graph_pass.check(record)
            record = record.after(graph_pass)
        return record

    def run(
        self, gm: torch.fx.GraphModule, observe: Callable[[str, torch.fx.GraphModule], None] | None = None
    ) -> torch.fx.GraphModule:
        """Apply the passes; ``observe(pass name, gm)``, when given, sees the graph after each."""
        self.check(record_of(gm))
        for graph_pass in self.passes:
            gm = graph_pass(gm)
            if observe is not None:
                observe(graph_pass.name, gm)
        return gm
