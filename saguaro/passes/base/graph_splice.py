"""Helpers the passes share (inline a traced function, add inputs, replace outputs), :class:`PassError`."""

from __future__ import annotations

import functools
import inspect

import torch
import torch.fx

from saguaro.core.errors import SaguaroError


class PassError(SaguaroError):
    """A pass cannot rewrite a graph (names the pass and FX node) or lacks a required fact (names both)."""


def get_attribute(gm: torch.nn.Module, path: str):
    """The attribute at dotted ``path`` of ``gm`` (a ``get_attr`` target)."""
    for part in path.split("."):
        gm = getattr(gm, part)
    return gm


def replace_node(graph: torch.fx.Graph, node: torch.fx.Node, out: torch.fx.Node) -> None:
    """Make ``out`` stand for ``node`` (its ``val``, ``tensor_meta``, stack trace), then erase ``node``."""
    out.meta.update({key: v for key, v in node.meta.items() if key in ("val", "tensor_meta", "stack_trace")})
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def drop_unread_attributes(gm: torch.fx.GraphModule, targets) -> int:
    """Delete each of ``targets`` no node of ``gm`` reads (the model keeps its own); returns the bytes."""
    read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    dropped = 0
    for target in set(targets) - read:
        *path, name = target.split(".")
        owner = gm
        for part in path:
            owner = getattr(owner, part, None)
            if owner is None:
                break
        value = getattr(owner, name, None) if owner is not None else None
        if isinstance(value, torch.Tensor):
            dropped += value.numel() * value.element_size()
            delattr(owner, name)
    return dropped


def add_inputs(gm: torch.fx.GraphModule, names: list[str]) -> list[torch.fx.Node]:
    """Append graph inputs after the existing ones (the signature must be flat)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    nodes = []
    anchor = placeholders[-1]
    for name in names:
        with gm.graph.inserting_after(anchor):
            anchor = gm.graph.placeholder(name)
        nodes.append(anchor)
    return nodes


def inline_function(gm: torch.fx.GraphModule, fn, args: list, before: torch.fx.Node, **constants):
    """Trace ``fn(*args, **constants)`` into ``gm`` before ``before``; ``args`` (graph nodes) bind its leading
    parameters. Returns the node (or tuple of nodes) ``fn`` returns."""
    bound = functools.partial(fn, **constants) if constants else fn
    params = list(inspect.signature(fn).parameters)[: len(args)]

    # the tracer makes one placeholder per named parameter, so the entry point needs real names
    namespace = {"bound": bound}
    exec(f"def entry({', '.join(params)}):\n    return bound({', '.join(params)})\n", namespace)
    sub = torch.fx.symbolic_trace(namespace["entry"])
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    val_map = dict(zip(placeholders, args))
    with gm.graph.inserting_before(before):
        out = gm.graph.graph_copy(sub.graph, val_map)
    return out


def output_node(gm: torch.fx.GraphModule) -> torch.fx.Node:
    return next(n for n in reversed(gm.graph.nodes) if n.op == "output")


def replace_outputs(gm: torch.fx.GraphModule, values) -> torch.fx.GraphModule:
    """Make ``values`` (a node or tuple of nodes) the graph's outputs; drop what became dead."""
    out = output_node(gm)
    out.args = (tuple(values) if isinstance(values, (tuple, list)) else (values,),)
    gm.graph.eliminate_dead_code(is_impure_node=keeps_mutations)
    gm.graph.lint()
    gm.recompile()
    return gm


def keeps_mutations(node: torch.fx.Node) -> bool:
    """Whether dead-code elimination must keep ``node``: a placeholder, a mutating op (the KV writes) or an
    in-place method on a graph input (AR's round writes the sequence buffers)."""
    if node.op == "placeholder":
        return True
    if (
        node.op == "call_method"
        and node.target.endswith("_")
        and not node.target.startswith("__")
        and node.args
        and getattr(node.args[0], "op", None) == "placeholder"
    ):
        return True
    return node.is_impure() or (
        node.op == "call_function"
        and getattr(node.target, "_schema", None) is not None
        and node.target._schema.is_mutable
    )


def logits_node(gm: torch.fx.GraphModule) -> torch.fx.Node:
    """The captured graph's single output: the logits ``[B, T, V]``."""
    out = output_node(gm)
    values = out.args[0]
    values = values if isinstance(values, (tuple, list)) else (values,)
    if len(values) != 1 or not isinstance(values[0], torch.fx.Node):
        raise PassError(
            f"FX node {out.name!r}: expected the graph to return only the logits, found {len(values)} "
            "outputs (was an epilogue already spliced?)"
        )
    return values[0]
