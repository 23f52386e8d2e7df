"""A stage graph as text, DOT and SVG: torch.fx's own printer and graph drawer (``pydot``), whole or
with one box per decoder layer (``torch.fx.passes.split_module`` groups the nodes)."""

from __future__ import annotations

import re
import shutil

import torch
from torch.fx.passes.split_module import split_module

LAYER = re.compile(r"layers[._](\d+)(?:[._]|$)")


def layer_of(node: torch.fx.Node) -> int | None:
    """The decoder layer a node belongs to: from its ``nn_module_stack`` (export's metadata) or, for a
    parameter read, its name; None for nodes outside the layers."""
    for value in (node.meta.get("nn_module_stack") or {}).values():
        path = value[0] if isinstance(value, tuple) else str(value)
        match = LAYER.search(path)
        if match:
            return int(match.group(1))
    if node.op == "get_attr":
        match = LAYER.search(str(node.target))
        if match:
            return int(match.group(1))
    return None


def layer_groups(gm: torch.fx.GraphModule) -> dict:
    """``{node: group}``: ``"inputs"`` before the first layer, ``"layer_N"``, ``"head"`` after the last
    layer. A node between layers joins the layer before it, so the groups run in graph order."""
    nodes = list(gm.graph.nodes)
    layered = [i for i, n in enumerate(nodes) if layer_of(n) is not None and n.op != "get_attr"]
    first, last = (layered[0], layered[-1]) if layered else (len(nodes), -1)
    groups, current = {}, "inputs"
    for i, node in enumerate(nodes):
        layer = layer_of(node)
        if node.op == "get_attr":
            groups[node] = f"layer_{layer}" if layer is not None else ("inputs" if i < first else "head")
            continue
        if layer is not None:
            current = f"layer_{layer}"
        elif i > last:
            current = "head"
        groups[node] = current if i >= first else "inputs"
    return groups


def collapsed(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The graph with one ``call_module`` node per group of :func:`layer_groups` (``submod_layer_0``, ...)."""
    groups = layer_groups(gm)
    order = list(dict.fromkeys(groups[n] for n in gm.graph.nodes if n.op not in ("placeholder", "output")))
    rank = {g: i for i, g in enumerate(order)}
    # split_module names submodules submod_<key>; keys sort in graph order through the rank prefix
    return split_module(
        gm, gm, lambda node: f"{rank[groups[node]]:02d}_{groups[node]}", keep_original_order=True
    )


def graph_text(gm: torch.fx.GraphModule, expand: bool = True) -> str:
    """Readable text: the graph's nodes (``torch.fx.Graph.__str__``), or with ``expand=False`` the
    collapsed graph followed by each group's node count."""
    if expand:
        return str(gm.graph)
    top = collapsed(gm)
    sizes = [
        f"  {name}: {len(sub.graph.nodes)} nodes"
        for name, sub in top.named_children()
        if isinstance(sub, torch.fx.GraphModule)
    ]
    return str(top.graph) + "\ngroups:\n" + "\n".join(sizes)


def graph_dot(gm: torch.fx.GraphModule, name: str, expand: bool = False):
    """A ``pydot.Dot`` drawn by :class:`torch.fx.passes.graph_drawer.FxGraphDrawer`: every node with
    ``expand``, else one box per decoder layer."""
    from torch.fx.passes.graph_drawer import FxGraphDrawer

    drawn = gm if expand else collapsed(gm)
    safe = re.sub(r"\W", "_", name)
    return FxGraphDrawer(
        drawn, safe, ignore_getattr=not expand, ignore_parameters_and_buffers=True
    ).get_main_dot_graph()


def have_dot() -> bool:
    """Whether Graphviz's ``dot`` (needed for SVG) is installed."""
    return shutil.which("dot") is not None


def to_svg(dot_graph) -> str:
    """SVG text of a ``pydot.Dot`` (runs Graphviz ``dot``); raises RuntimeError without it."""
    if not have_dot():
        raise RuntimeError(
            "Graphviz `dot` is not installed (apt-get install graphviz); DOT output still works"
        )
    return dot_graph.create_svg().decode()
