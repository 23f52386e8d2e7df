"""The round DAG of a mode (:mod:`saguaro.core.schedule`) as DOT: lanes as clusters, each node's
measured cost, the critical path in red."""

from __future__ import annotations

import networkx as nx

from saguaro.core.schedule import critical_path

LANE_COLORS = {"target": "#dbe9f6", "draft": "#e3f2dc", "host": "#f2f2f2"}
CRITICAL = "#c0392b"


def schedule_dot(g: nx.DiGraph, title: str | None = None):
    """A ``pydot.Dot`` of the round DAG ``g``; nodes show their stage and cost (ms), the critical path
    (:func:`saguaro.core.schedule.critical_path`, on a hit) is drawn red and bold."""
    import pydot

    path, length = critical_path(g)
    on_path, path_edges = set(path), set(zip(path, path[1:]))
    mode = g.graph.get("mode", "round")
    dot = pydot.Dot(
        graph_type="digraph",
        rankdir="LR",
        fontname="Helvetica",
        label=title or f"{mode} round (k={g.graph.get('k')}): critical path {1000 * length:.2f} ms",
        labelloc="t",
    )
    lanes: dict = {}
    for node, data in g.nodes(data=True):
        lane = data["lane"]
        if lane not in lanes:
            lanes[lane] = pydot.Cluster(
                f"lane_{lane}",
                label=f"{lane} lane",
                style="filled",
                fillcolor=LANE_COLORS.get(lane, "white"),
                fontname="Helvetica",
            )
        stage = data.get("stage")
        label = f"{node}\\n{stage.qualified if stage is not None else 'host'}\\n{1000 * data['cost']:.2f} ms"
        critical = node in on_path
        lanes[lane].add_node(
            pydot.Node(
                _quote(node),
                label=f'"{label}"',
                shape="box",
                style='"rounded,filled"',
                fillcolor="white",
                color=CRITICAL if critical else "black",
                penwidth="2.5" if critical else "1",
                fontname="Helvetica",
            )
        )
    for cluster in lanes.values():
        dot.add_subgraph(cluster)
    for a, b in g.edges:
        critical = (a, b) in path_edges
        dot.add_edge(
            pydot.Edge(
                _quote(a),
                _quote(b),
                color=CRITICAL if critical else "black",
                penwidth="2.5" if critical else "1",
            )
        )
    return dot


def _quote(name: str) -> str:
    return f'"{name}"'
