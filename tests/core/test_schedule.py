"""The round schedule: DAG structure, critical path, expected overlap, and that it drives the draft lane."""

import networkx as nx
import pytest

import saguaro
from saguaro.core.schedule import DEFAULT_COST_S, critical_path, expected_overlap, lane_order, round_schedule
from saguaro.runtime.draft import tree
from tests.conftest import tiny_pair
from tests.models import prompts


def test_ssd_round_structure():
    g = round_schedule("ssd", 3)
    assert nx.is_directed_acyclic_graph(g)
    assert lane_order(g, "draft") == [
        "draft.glue",
        "draft.tree.1",
        "draft.tree.2",
        "draft.tree.3",
        "fallback",
    ]
    assert lane_order(g, "target") == ["target.verify"]
    assert set(g.predecessors("match")) == {"target.verify", "draft.tree.3"}
    assert g.nodes["draft.glue"]["stage"].qualified == "draft.glue"
    assert (
        g.nodes["draft.tree.2"]["stage"].qualified == "draft.tree_greedy"
        and g.nodes["draft.tree.2"]["depth"] == 2
    )
    assert "a" in g.nodes["target.verify"]["outputs"]


def test_sd_round_is_a_chain_into_verify():
    g = round_schedule("sd", 4, sampled=True)
    assert list(nx.topological_sort(g)) == [f"draft.step.{i}" for i in range(1, 5)] + ["target.verify"]
    assert g.nodes["target.verify"]["stage"].qualified == "target.verify_sampled"


def test_the_greedy_round_stages_cost_the_nodes_they_stand_in_for():
    """Greedy rounds run AR's round stage and SD's verify-and-commit stage: their times cost the step and
    verify nodes when those stages never ran; a measured step or verify keeps its own."""
    costs = {"target.verify_round_greedy": 7e-3, "target.round_greedy": 2e-3}
    assert round_schedule("sd", 3, costs=costs).nodes["target.verify"]["cost"] == 7e-3
    assert round_schedule("ar", 3, costs=costs).nodes["target.step"]["cost"] == 2e-3
    own = round_schedule("sd", 3, costs=dict(costs, **{"target.verify_greedy": 5e-3}))
    assert own.nodes["target.verify"]["cost"] == 5e-3
    assert round_schedule("sd", 3).nodes["target.verify"]["cost"] == DEFAULT_COST_S


def test_critical_path_and_overlap_follow_costs():
    costs = {"target.verify_greedy": 10e-3, "draft.glue": 1e-3, "draft.tree_greedy": 1e-3, "match": 0.1e-3}
    g = round_schedule("ssd", 5, costs=costs)
    path, length = critical_path(g)
    assert path == ["target.verify", "match"] and length == pytest.approx(10.1e-3)
    assert expected_overlap(g) == pytest.approx(1.0)  # 6 ms of draft work hides behind 10 ms of verify
    slow = dict(costs, **{"draft.tree_greedy": 3e-3})  # 16 ms of draft work: the draft lane is critical
    path, length = critical_path(round_schedule("ssd", 5, costs=slow))
    assert path[0] == "draft.glue" and path[-1] == "match" and length == pytest.approx(16.1e-3)
    assert expected_overlap(round_schedule("ssd", 5, costs=slow)) == pytest.approx((26.1 - 16.1) / 16)


def test_runtime_builds_in_schedule_order(monkeypatch):
    target, draft, _ = tiny_pair("llama")
    # a fixed tree (the planner's first rounds may build none)
    program = saguaro.compile(
        target,
        draft,
        k=3,
        mode="ssd",
        lane="thread",
        fan_out="geometric",
        backend="eager",
        sd_when_faster=False,
    )
    seen = []
    real_glue, real_depth = tree.TreeBuild.glue, tree.TreeBuild.depth
    monkeypatch.setattr(tree.TreeBuild, "glue", lambda self: (seen.append("draft.glue"), real_glue(self))[1])
    monkeypatch.setattr(
        tree.TreeBuild,
        "depth",
        lambda self, d, stage: (seen.append(f"draft.tree.{d}"), real_depth(self, d, stage))[1],
    )
    ids, mask = prompts(1, 6, seed=1)
    out = program.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)
    assert seen[:4] == ["draft.glue", "draft.tree.1", "draft.tree.2", "draft.tree.3"]
    # the stats read the program's schedule, costed with the stage times this generation measured
    g = program.schedule
    assert (
        g.nodes["draft.glue"]["cost"] != DEFAULT_COST_S and g.nodes["target.verify"]["cost"] != DEFAULT_COST_S
    )
    path, length = critical_path(g)
    assert out.stats["critical_path"] == path and path[-1] == "match"
    assert out.stats["critical_path_ms"] == pytest.approx(1000 * length)
    assert out.stats["expected_overlap"] == pytest.approx(expected_overlap(g))
    program.close()
