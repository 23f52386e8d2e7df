"""``saguaro.inspect``: every view runs on a tiny pair; the passes table counts the graphs' nodes; the
splice_epilogue diff of a verify stage shows the verification nodes it adds; DOT and SVG parse."""

import re
import xml.etree.ElementTree as ET

import pydot
import pytest

import saguaro
from saguaro.core.schedule import DEFAULT_COST_S, critical_path
from saguaro.core.stages import DRAFT_GLUE, STAGES, TARGET_VERIFY
from saguaro.inspection.graph_view import have_dot
from tests.conftest import tiny_pair

ASSIGNED = re.compile(r"^\s+(\w+) = ", re.M)
needs_dot = pytest.mark.skipif(
    not have_dot(), reason="Graphviz `dot` is not installed (apt-get install graphviz)"
)


@pytest.fixture(scope="module")
def inspector():
    target, draft, _ = tiny_pair("llama")
    program = saguaro.compile(
        target, draft, k=3, mode="ssd", lane="thread", backend="eager", sd_when_faster=False
    )  # costs measured in this process
    yield saguaro.inspect(program)
    program.close()


def test_passes_table_counts_the_nodes_of_the_stage_graphs(inspector):
    program = inspector.program
    table = inspector.passes()
    for stage in STAGES:
        steps = inspector.pass_steps(stage)
        assert [s.name for s in steps] == [
            "captured",
            "specialize_attention",
            "splice_epilogue",
            "last_row_head",
            "lower_attention",
        ]
        assert steps[0].nodes == len(program.runner(stage.model).build.graph_module.graph.nodes)
        for before, after in zip(steps, steps[1:]):
            assert after.delta == after.nodes - before.nodes
        # eager: the program's own stage callable is the graph the pipeline built
        assert steps[-1].nodes == len(program.runner(stage.model).stage(stage).graph.nodes)
        row = re.search(rf"^{re.escape(stage.qualified)}\s+splice_epilogue\s+(\d+)\s+([+-]\d+)$", table, re.M)
        assert row and int(row.group(1)) == steps[2].nodes and int(row.group(2)) == steps[2].delta


def test_splice_epilogue_diff_shows_the_verification_nodes(inspector):
    steps = inspector.pass_steps("verify_greedy")
    i = [s.name for s in steps].index("splice_epilogue")
    added = set(ASSIGNED.findall(steps[i].code)) - set(ASSIGNED.findall(steps[i - 1].code))
    diff = inspector.pass_diff("target.verify_greedy", "splice_epilogue")
    plus = "\n".join(
        line for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")
    )
    assert added and all(re.search(rf"\b{name} = ", plus) for name in added)
    assert re.search(r"^\+def forward\(.*draft_tokens\)", diff, re.M)  # the input the epilogue appends
    assert "argmax" in plus  # greedy verification compares the target's argmax with the draft tokens
    with pytest.raises(
        ValueError, match="'flatten_signature' is not in the pipeline of target.verify_greedy"
    ):
        inspector.pass_diff("target.verify_greedy", "flatten_signature")  # a base pass, not a stage pass


def test_graph_text_dot_and_svg(inspector):
    layers = inspector.program.target.spec.num_layers
    text = inspector.graph(TARGET_VERIFY.greedy, expand=True)
    assert "draft_tokens" in text and text.count("\n") > 100
    collapsed = inspector.graph("target.verify_greedy")
    assert collapsed.count("call_module[target=submod_") == layers + 2  # inputs, each layer, head
    for expand in (False, True):
        dot = inspector.graph(DRAFT_GLUE, format="dot", expand=expand)
        (parsed,) = pydot.graph_from_dot_data(dot)
        boxes = [n for n in parsed.get_nodes() if n.get_name() not in ("node", "edge", "graph")]
        if expand:
            assert len(boxes) > 50
        else:
            assert (
                sum("submod_" in n.get_name() for n in boxes) == inspector.program.draft.spec.num_layers + 2
            )
    with pytest.raises(ValueError, match="ambiguous"):
        inspector.graph("prefill")
    with pytest.raises(ValueError, match="format='png'"):
        inspector.graph("glue", format="png")


@needs_dot
def test_graph_and_schedule_svg_parse(inspector):
    # the stage graph is drawn collapsed to one box per decoder layer; the schedule names its stages
    for svg, wanted in (
        (inspector.graph("glue", format="svg"), "_layer_0"),
        (inspector.schedule("ssd", format="svg"), "draft.glue"),
    ):
        root = ET.fromstring(svg[svg.index("<svg") :])
        labels = {"".join(t.itertext()) for t in root.iter() if t.tag.endswith("text")}
        assert any(wanted in label for label in labels), sorted(labels)[:20]


def test_schedule_dot_has_lane_clusters_costs_and_the_critical_path(inspector):
    dot = inspector.schedule("ssd", format="dot", measure=True)
    (parsed,) = pydot.graph_from_dot_data(dot)
    clusters = {c.get_name(): c for c in parsed.get_subgraphs()}
    assert set(clusters) == {"cluster_lane_target", "cluster_lane_draft", "cluster_lane_host"}
    cost = inspector.costs["draft.glue"] * 1000  # measured by the traced run, not the 1 ms default
    assert inspector.costs["draft.glue"] != DEFAULT_COST_S and f"{cost:.2f} ms" in dot
    path, _ = critical_path(inspector.schedule_graph("ssd"))
    red = {
        n.get_name().strip('"')
        for c in clusters.values()
        for n in c.get_nodes()
        if "c0392b" in str(n.get("color"))
    }
    assert red == set(path)
    for mode in ("ar", "sd"):
        assert pydot.graph_from_dot_data(inspector.schedule(mode))


def test_kernels_need_inductor(inspector):
    with pytest.raises(ValueError, match="backend='inductor'"):
        inspector.kernels()
