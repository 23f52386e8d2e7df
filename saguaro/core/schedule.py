"""One round's stages as a ``networkx`` DAG of data dependencies; a lane runs its nodes in topological order.

Nodes: ``lane`` (target, draft, host), ``stage`` (a :class:`~saguaro.core.stages.Stage` or None), ``depth``
(tree nodes, from 1), ``inputs`` / ``outputs`` (value names), ``cost`` (seconds a call, or DEFAULT_COST_S)."""

from __future__ import annotations

import networkx as nx

from saguaro.core.config import MODES
from saguaro.core.stages import (
    DRAFT_GLUE,
    DRAFT_STEP,
    DRAFT_TREE,
    ROUND_STAGES,
    TARGET_STEP,
    TARGET_VERIFY,
    Stage,
)

DEFAULT_COST_S = 1e-3
MATCH, FALLBACK = "match", "fallback"  # the host's lookup of the outcome, and the draft's work on a miss


def node_name(stage: Stage, index: int | None = None) -> str:
    """``model.family`` (``target.verify``), with ``.index`` for repeated calls (``draft.tree.2``)."""
    base = f"{stage.model}.{stage.family}"
    return base if index is None else f"{base}.{index}"


# a stage whose round stage the greedy rounds run instead (AR's step, SD's verify): costed by the round's
# measured time when its own was never measured
_ROUND_OF = {plain: round_stage for round_stage, plain in ROUND_STAGES.items()}


def _add(g, name, lane, stage, inputs, outputs, costs, **attrs):
    key = stage.qualified if stage is not None else name
    round_stage = _ROUND_OF.get(stage)
    cost = costs.get(key, costs.get(round_stage.qualified, DEFAULT_COST_S) if round_stage else DEFAULT_COST_S)
    g.add_node(name, lane=lane, stage=stage, inputs=tuple(inputs), outputs=tuple(outputs), cost=cost, **attrs)


def round_schedule(mode: str, k: int, sampled: bool = False, costs: dict | None = None) -> nx.DiGraph:
    """One round's DAG (another ``mode``: ``ValueError``); ``costs``: seconds a call by stage.qualified."""
    temperature = 1.0 if sampled else 0.0
    g = nx.DiGraph(mode=mode, k=k)
    costs = costs or {}
    if mode == "ar":
        _add(g, node_name(TARGET_STEP), "target", TARGET_STEP, ["r"], ["r'"], costs)
        return g
    verify, step = TARGET_VERIFY.for_temperature(temperature), DRAFT_STEP.for_temperature(temperature)
    speculation = ["r"] + [f"x{i}" for i in range(1, k + 1)]
    if mode == "sd":
        previous = "r"
        for i in range(1, k + 1):
            _add(g, node_name(step, i), "draft", step, [previous], [f"x{i}"], costs)
            if i > 1:
                g.add_edge(node_name(step, i - 1), node_name(step, i))
            previous = f"x{i}"
        _add(g, node_name(verify), "target", verify, speculation, ["a", "r'"], costs)
        g.add_edge(node_name(step, k), node_name(verify))
        return g
    if mode != "ssd":
        raise ValueError(f"mode={mode!r} is not allowed: choose one of {', '.join(MODES)}")
    tree = DRAFT_TREE.for_temperature(temperature)
    _add(g, node_name(verify), "target", verify, speculation, ["a", "r'"], costs)
    _add(
        g, node_name(DRAFT_GLUE), "draft", DRAFT_GLUE, speculation, ["candidates", "ranked", "glue_kv"], costs
    )
    previous = node_name(DRAFT_GLUE)
    for depth in range(1, k + 1):
        name = node_name(tree, depth)
        _add(g, name, "draft", tree, [f"tree_in.{depth}"], [f"tree_out.{depth}"], costs, depth=depth)
        g.add_edge(previous, name)
        previous = name
    _add(
        g, MATCH, "host", None, ["a", "r'", "candidates", f"tree_out.{k}"], ["hit", "next_speculation"], costs
    )
    g.add_edge(node_name(verify), MATCH)
    g.add_edge(previous, MATCH)
    _add(g, FALLBACK, "draft", step, ["hit", "r'"], ["next_speculation"], costs)
    g.add_edge(MATCH, FALLBACK)
    return g


def build_steps(g: nx.DiGraph) -> list[str]:
    """The draft lane's cache-building nodes in order (everything on the draft lane but the fallback)."""
    return [n for n in lane_order(g, "draft") if n != FALLBACK]


def lane_order(g: nx.DiGraph, lane: str) -> list[str]:
    """The nodes of ``lane`` in the topological order of the DAG (ties broken by name)."""
    return [n for n in nx.lexicographical_topological_sort(g) if g.nodes[n]["lane"] == lane]


def serialized(g: nx.DiGraph) -> nx.DiGraph:
    """``g`` plus edges that chain each lane's nodes: one lane runs one node at a time."""
    s = g.copy()
    for lane in {d["lane"] for _, d in g.nodes(data=True)}:
        order = lane_order(g, lane)
        s.add_edges_from(zip(order, order[1:]))
    return s


def critical_path(g: nx.DiGraph, on_hit: bool = True) -> tuple[list[str], float]:
    """The longest cost-weighted path of the lane-serialised DAG and its seconds (``on_hit``: no fallback)."""
    s = serialized(g)
    if on_hit and FALLBACK in s:
        s.remove_node(FALLBACK)
    best, best_path = {}, {}
    for node in nx.topological_sort(s):
        preds = list(s.predecessors(node))
        start = max((best[p] for p in preds), default=0.0)
        parent = max(preds, key=lambda p: best[p], default=None)
        best[node] = start + s.nodes[node]["cost"]
        best_path[node] = (best_path[parent] if parent else []) + [node]
    end = max(best, key=best.get)
    return best_path[end], best[end]


def expected_overlap(g: nx.DiGraph) -> float:
    """Share of the draft lane's work hidden behind the target on a hit: 1 when it costs nothing."""
    draft = sum(d["cost"] for n, d in g.nodes(data=True) if d["lane"] == "draft" and n != FALLBACK)
    if draft == 0:
        return 1.0
    total = sum(d["cost"] for n, d in g.nodes(data=True) if n != FALLBACK)
    _, length = critical_path(g)
    return max(0.0, min(1.0, (total - length) / draft))
