"""The schedule: a ``networkx`` DAG of one round's stages, their lanes and data dependencies.

Nodes carry ``lane`` (``target``/``draft``/``host``), ``stage`` (the stage graph it calls, if any),
``inputs``/``outputs`` (names of the values it reads and writes) and ``cost`` (seconds, measured
per stage call; 1 ms before anything is measured). Edges are data dependencies. The runtime
executes each lane's nodes in the topological order this DAG yields; the critical path and the
expected overlap are computed from it.
"""

from __future__ import annotations

import networkx as nx

DEFAULT_COST_S = 1e-3


def _add(g, name, lane, stage, inputs, outputs, costs):
    g.add_node(name, lane=lane, stage=stage, inputs=tuple(inputs), outputs=tuple(outputs),
               cost=costs.get(stage or name, DEFAULT_COST_S) if costs else DEFAULT_COST_S)


def round_schedule(mode: str, k: int, sampled: bool = False, costs: dict | None = None) -> nx.DiGraph:
    """The DAG of one round of ``mode`` (``ar``, ``sd`` or ``ssd``) with speculation length ``k``."""
    kind = "sampled" if sampled else "greedy"
    g = nx.DiGraph(mode=mode, k=k)
    costs = costs or {}
    if mode == "ar":
        _add(g, "target.step", "target", "target.step", ["r"], ["r'"], costs)
        return g
    if mode == "sd":
        previous = "r"
        for i in range(1, k + 1):
            _add(g, f"draft.step.{i}", "draft", f"draft.step_{kind}", [previous], [f"x{i}"], costs)
            if i > 1:
                g.add_edge(f"draft.step.{i - 1}", f"draft.step.{i}")
            previous = f"x{i}"
        _add(g, "target.verify", "target", f"target.verify_{kind}", ["r"] + [f"x{i}" for i in range(1, k + 1)],
             ["a", "r'"], costs)
        g.add_edge(f"draft.step.{k}", "target.verify")
        return g
    if mode != "ssd":
        raise ValueError(f"mode={mode!r} is not allowed: choose one of ar, sd, ssd")
    speculation = ["r"] + [f"x{i}" for i in range(1, k + 1)]
    _add(g, "target.verify", "target", f"target.verify_{kind}", speculation, ["a", "r'"], costs)
    _add(g, "draft.glue", "draft", "draft.glue", speculation, ["candidates", "ranked", "glue_kv"], costs)
    previous = "draft.glue"
    for depth in range(1, k + 1):
        name = f"draft.tree.{depth}"
        _add(g, name, "draft", f"draft.tree_{kind}", [f"tree_in.{depth}"], [f"tree_out.{depth}"], costs)
        g.add_edge(previous, name)
        previous = name
    _add(g, "match", "host", None, ["a", "r'", "candidates", f"tree_out.{k}"], ["hit", "next_speculation"], costs)
    g.add_edge("target.verify", "match")
    g.add_edge(previous, "match")
    _add(g, "fallback", "draft", f"draft.step_{kind}", ["hit", "r'"], ["next_speculation"], costs)
    g.add_edge("match", "fallback")
    return g


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
    """The longest cost-weighted path through the lane-serialised DAG, and its length in seconds.

    ``on_hit`` drops the fallback node: on a cache hit the next speculation needs no draft work.
    """
    s = serialized(g)
    if on_hit and "fallback" in s:
        s.remove_node("fallback")
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
    draft = sum(d["cost"] for n, d in g.nodes(data=True) if d["lane"] == "draft" and n != "fallback")
    if draft == 0:
        return 1.0
    total = sum(d["cost"] for n, d in g.nodes(data=True) if n != "fallback")
    _, length = critical_path(g)
    return max(0.0, min(1.0, (total - length) / draft))
