"""Pass contracts: every pass declares what it requires and guarantees, and a pass run out of order
fails at once with a PassError naming the pass and the missing fact, before touching the graph."""

from dataclasses import replace

import pytest

from saguaro.capture import capture
from saguaro.core.stages import STAGES, TARGET_VERIFY
from saguaro.passes import PIPELINE
from saguaro.passes.base.graph_pass import (
    FACTS,
    GENERIC_MASK,
    LOGITS_OUTPUT,
    GraphPass,
    PassManager,
    copy_graph,
    record_of,
)
from saguaro.passes.base.graph_splice import PassError
from saguaro.passes.lower_attention import LowerAttention
from saguaro.passes.pipeline import build_stage, stage_passes
from saguaro.passes.specialize_attention import SpecializeAttention
from saguaro.passes.splice_epilogue import SpliceEpilogue
from tests.models import tiny_target
from tests.passes.stage_helpers import base_graph

BASE_PASSES = ["strip_runtime_checks", "flatten_signature"]


def every_pass():
    passes = list(PIPELINE)
    for stage in STAGES:
        passes += stage_passes(stage, 8, "inline", 0, linears="reduction", narrow=True, fuse=True)
    return passes


def test_every_pass_declares_what_it_requires_and_guarantees():
    for graph_pass in every_pass():
        assert graph_pass.name and graph_pass.guarantees, f"{graph_pass.name} guarantees nothing"
        assert graph_pass.requires or len(graph_pass.requires_nothing_because) > 20, (
            f"{graph_pass.name} requires nothing and does not say why"
        )
        assert (graph_pass.requires | graph_pass.guarantees | graph_pass.invalidates) <= set(FACTS)
    names = {p.name for p in every_pass()}
    assert names == {
        *BASE_PASSES,
        "specialize_attention",
        "splice_epilogue",
        "last_row_head",
        "lower_attention",
        "fuse_projections",
        "linear_as_reduction",
        "narrow_weights",
    }
    # the base pipeline requires nothing: it runs on capture's graph
    assert [p.requires for p in PIPELINE] == [frozenset(), frozenset()]
    with pytest.raises(TypeError, match="pass class Undeclared: declare name, guarantees"):

        class Undeclared(GraphPass):
            name = "undeclared"
            requires = frozenset()

            def run(self, gm):
                return gm


def test_lower_attention_before_splice_epilogue_fails_before_any_pass_runs():
    _, captured = base_graph()
    gm = copy_graph(captured.graph_module)
    nodes = len(gm.graph.nodes)
    stage = TARGET_VERIFY.greedy
    misordered = PassManager([SpecializeAttention("causal"), LowerAttention("inline"), SpliceEpilogue(stage)])
    seen = []
    with pytest.raises(
        PassError,
        match=r"^lower_attention requires epilogue_spliced, which no earlier pass "
        r"guarantees \(passes before it: strip_runtime_checks, flatten_signature, "
        r"specialize_attention\)$",
    ):
        misordered.run(gm, observe=lambda name, _: seen.append(name))
    assert seen == [] and len(gm.graph.nodes) == nodes, "a pass ran before the order was refused"
    assert record_of(gm).ran == tuple(BASE_PASSES)


def test_a_pass_run_by_hand_checks_the_graph_record():
    _, captured = base_graph()
    with pytest.raises(
        PassError,
        match=r"^lower_attention requires epilogue_spliced, which no earlier pass "
        r"guarantees; and stage_mask, which no earlier pass guarantees",
    ):
        LowerAttention("inline")(copy_graph(captured.graph_module))
    stage_graph = build_stage(captured.graph_module, TARGET_VERIFY.greedy, 8)
    assert record_of(stage_graph).ran == (
        *BASE_PASSES,
        "specialize_attention",
        "splice_epilogue",
        "last_row_head",
        "lower_attention",
    )
    assert not {GENERIC_MASK, LOGITS_OUTPUT} & record_of(stage_graph).facts
    with pytest.raises(
        PassError,
        match=r"^splice_epilogue requires logits_output, which splice_epilogue "
        r"invalidated",
    ):
        SpliceEpilogue(TARGET_VERIFY.greedy)(stage_graph)  # an epilogue is already spliced
    with pytest.raises(
        PassError,
        match=r"^specialize_attention requires generic_mask, which specialize_attention "
        r"invalidated",
    ):
        SpecializeAttention("tree")(stage_graph)


def test_a_stage_pass_on_a_graph_without_the_base_pipeline_is_named():
    raw = capture(tiny_target("llama")).graph_module  # captured, no flatten_signature
    seen = []
    with pytest.raises(
        PassError,
        match=r"^splice_epilogue requires flat_signature, which no earlier pass guarantees "
        r"\(passes before it: specialize_attention\)$",
    ):
        build_stage(raw, TARGET_VERIFY.greedy, 8, observe=lambda name, _: seen.append(name))
    assert seen == ["captured"], "the stage pipeline started before its order was checked"


def test_splice_epilogue_returns_what_the_stage_table_declares():
    _, captured = base_graph()
    for stage in STAGES:
        gm = build_stage(captured.graph_module, stage, 8)
        out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
        assert len(out.args[0]) == len(stage.outputs), stage.qualified
    wrong = replace(TARGET_VERIFY.greedy, outputs=("accepted",))
    with pytest.raises(
        PassError,
        match=r"splice_epilogue\(target.verify_greedy\): FX node 'output' would return "
        r"2 value\(s\) of verification.verify_greedy, but the stage table declares 1",
    ):
        build_stage(captured.graph_module, wrong, 8)
    with pytest.raises(ValueError, match=r"width=0 is not allowed for stage draft.glue"):
        SpliceEpilogue(next(s for s in STAGES if s.ranked))
