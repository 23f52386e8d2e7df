"""A captured graph as plain JSON, what the capture cache keeps on disk: only what the passes and backends
read, so it reads back far faster than torch.export's serialized form
(docs/measurements/2026-12-07-figures-from-core-tensor-math-capture.md).

Kept: the nodes (``call_function`` targets: operator overloads or Python ``operator`` functions; arguments:
nodes, numbers, strings, dtypes, devices, layouts, memory formats, in lists, tuples; else :class:`NotKept`),
the pytree signature, :data:`KEPT_META` and a :class:`TensorSpec` per tensor ``meta["val"]``. Not kept: the
guard call (``flatten_signature`` drops it anyway). ``get_attr`` paths bind to the new model's tensors.
"""

from __future__ import annotations

import json
import math
import operator
from typing import Any, NamedTuple

import torch
import torch.fx
from torch.utils import _pytree as pytree

VERSION = 1
KEPT_META = ("nn_module_stack", "stack_trace", "torch_fn", "custom")
GUARDS = "_guards_fn"
_ENUMS = {"dtype": torch.dtype, "layout": torch.layout, "memory_format": torch.memory_format}


class NotKept(Exception):
    """The graph holds something this form does not write (the capture then stays in memory only)."""


class TensorSpec(NamedTuple):
    """A read graph's ``meta["val"]``: dtype and shape (an int per static size, else a name: ``"s12"``)."""

    dtype: torch.dtype
    shape: tuple


def _encode(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        return {"node": value.name}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, (list, tuple)):
        items = [_encode(v) for v in value]
        return items if isinstance(value, list) else {"tuple": items}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    for kind, cls in _ENUMS.items():
        if isinstance(value, cls):
            return {kind: str(value).removeprefix("torch.")}
    raise NotKept(f"an argument of type {type(value).__name__}: {value!r}")


def _decode(value: Any, nodes: dict) -> Any:
    if isinstance(value, list):
        return [_decode(v, nodes) for v in value]
    if not isinstance(value, dict):
        return value
    ((kind, item),) = value.items()
    if kind == "node":
        return nodes[item]
    if kind == "tuple":
        return tuple(_decode(v, nodes) for v in item)
    if kind == "float":
        return float(item)
    if kind == "device":
        return torch.device(item)
    return _enum(kind, item)


def _enum(kind: str, name: str):
    """``torch.<name>``, checked to be a ``kind`` (dtype, layout, memory format)."""
    found = getattr(torch, name, None)
    if kind not in _ENUMS or not isinstance(found, _ENUMS[kind]):
        raise ValueError(f"unknown {kind} {name!r}")
    return found


def _target(node: torch.fx.Node) -> Any:
    if node.op != "call_function":
        return node.target
    if getattr(operator, getattr(node.target, "__name__", ""), None) is node.target:  # getitem, mul, ...
        return {"python": node.target.__name__}
    if not isinstance(node.target, torch._ops.OpOverload):
        raise NotKept(f"node {node.name} calls {node.target!r}, not an operator overload")
    return {"op": node.target._schema.name, "overload": node.target._overloadname}


def _operator(target: dict):
    if "python" in target:
        return getattr(operator, target["python"])
    namespace, name = target["op"].split("::")
    return getattr(getattr(getattr(torch.ops, namespace), name), target["overload"])


def _value(val: Any) -> dict | None:
    if not isinstance(val, torch.Tensor):
        return None
    return {
        "dtype": str(val.dtype).removeprefix("torch."),
        "shape": [s if isinstance(s, int) else str(s) for s in val.shape],
    }


def attribute_names(gm: torch.fx.GraphModule) -> list[str]:
    """The ``get_attr`` targets of ``gm``'s graph, sorted: the paths of the tensors the graph reads."""
    return sorted({node.target for node in gm.graph.nodes if node.op == "get_attr"})


def dumps(gm: torch.fx.GraphModule) -> str:
    """``gm`` (``ExportedProgram.module()``) as JSON text; :class:`NotKept` when it cannot be."""
    codegen = gm.graph._codegen
    if not isinstance(codegen, torch.fx.graph._PyTreeCodeGen):
        raise NotKept(f"a graph with {type(codegen).__name__}, not export's pytree signature")
    nodes = []
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target == GUARDS:
            continue
        if node.op == "call_module":
            raise NotKept(f"node {node.name} calls submodule {node.target}")
        meta = {key: node.meta[key] for key in KEPT_META if key in node.meta}
        try:
            json.dumps(meta)
        except (TypeError, ValueError) as exc:
            raise NotKept(f"node {node.name}'s metadata: {exc}") from exc
        nodes.append(
            dict(
                op=node.op,
                name=node.name,
                target=_target(node),
                args=_encode(node.args),
                kwargs={k: _encode(v) for k, v in node.kwargs.items()},
                meta=meta,
                val=_value(node.meta.get("val")),
            )
        )
    info = codegen.pytree_info
    return json.dumps(
        dict(
            version=VERSION,
            nodes=nodes,
            orig_args=list(info.orig_args),
            in_spec=pytree.treespec_dumps(info.in_spec),
            out_spec=pytree.treespec_dumps(info.out_spec),
        )
    )


def loads(text: str, root: torch.nn.Module) -> torch.fx.GraphModule:
    """The graph of :func:`dumps`'s ``text``, its ``get_attr`` paths bound to ``root``'s tensors."""
    data = json.loads(text)
    if data.get("version") != VERSION:
        raise ValueError(f"graph file version {data.get('version')!r}, this Saguaro reads {VERSION}")
    graph = torch.fx.Graph()
    nodes: dict = {}
    for item in data["nodes"]:
        target = _operator(item["target"]) if item["op"] == "call_function" else item["target"]
        node = graph.create_node(
            item["op"],
            target,
            _decode(item["args"], nodes),
            {k: _decode(v, nodes) for k, v in item["kwargs"].items()},
            name=item["name"],
        )
        if node.name != item["name"]:
            raise ValueError(f"node {item['name']!r} came back as {node.name!r}")
        node.meta.update(item["meta"])
        if "nn_module_stack" in node.meta:  # JSON has no tuples: (path, class) pairs as export writes them
            node.meta["nn_module_stack"] = {k: tuple(v) for k, v in node.meta["nn_module_stack"].items()}
        if "torch_fn" in node.meta:
            node.meta["torch_fn"] = tuple(node.meta["torch_fn"])
        if item["val"] is not None:
            val = item["val"]
            node.meta["val"] = TensorSpec(_enum("dtype", val["dtype"]), tuple(val["shape"]))
        nodes[node.name] = node
    in_spec, out_spec = pytree.treespec_loads(data["in_spec"]), pytree.treespec_loads(data["out_spec"])
    graph._codegen = torch.fx.graph._PyTreeCodeGen(
        torch.fx.graph._PyTreeInfo(data["orig_args"], in_spec, out_spec)
    )
    gm = torch.fx.GraphModule(root, graph)
    gm._in_spec, gm._out_spec = in_spec, out_spec
    return gm
