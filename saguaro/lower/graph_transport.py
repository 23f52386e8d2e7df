"""A stage GraphModule sent to another process node for node, rebuilt there with the same ``forward`` code.

The compile helper's compile must write the cache entries the sender's compile reads; pickling a
GraphModule traces it again on arrival, which renames and reorders nodes. Each node travels as its op,
name, target and arguments; a tensor attribute above :data:`SMALL_TENSOR_BYTES` as its metadata only
(:class:`EmptyTensor`, made uninitialised: a compile reads no values; the outputs are thrown away).
"""

from __future__ import annotations

import builtins
import importlib
from dataclasses import dataclass
from operator import attrgetter

import torch
import torch.fx as fx
from torch.fx.node import _get_qualified_name

SMALL_TENSOR_BYTES = 64 * 1024  # attributes up to this size travel with their values


@dataclass(frozen=True)
class EmptyTensor:
    """An attribute sent as its metadata: made uninitialised, a ``Parameter`` again if it was one."""

    shape: tuple
    stride: tuple
    dtype: torch.dtype
    parameter: bool
    requires_grad: bool

    def make(self) -> torch.Tensor:
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype)
        return torch.nn.Parameter(t, requires_grad=self.requires_grad) if self.parameter else t


@dataclass(frozen=True)
class _NodeRef:
    name: str


def _target_name(target) -> tuple:
    if isinstance(target, str):  # placeholder, get_attr, call_method, call_module
        return ("name", target)
    if isinstance(target, torch._ops.OpOverload):
        return ("op", target.namespace, target._opname, target._overloadname)
    return ("callable", _get_qualified_name(target))


def _target(encoded: tuple):
    kind = encoded[0]
    if kind == "name":
        return encoded[1]
    if kind == "op":
        _, namespace, name, overload = encoded
        return getattr(getattr(getattr(torch.ops, namespace), name), overload)
    parts = encoded[1].split(".")
    if len(parts) == 1:  # getattr, and other builtins
        return getattr(builtins, parts[0])
    for split in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for part in parts[split:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(f"cannot resolve the FX node target {encoded[1]!r}")


def _encode(arg):
    return fx.node.map_aggregate(arg, lambda a: _NodeRef(a.name) if isinstance(a, fx.Node) else a)


def _decode(arg, nodes: dict):
    return fx.node.map_aggregate(arg, lambda a: nodes[a.name] if isinstance(a, _NodeRef) else a)


def _sent(value):
    if isinstance(value, torch.Tensor) and value.untyped_storage().nbytes() > SMALL_TENSOR_BYTES:
        return EmptyTensor(
            tuple(value.shape),
            tuple(value.stride()),
            value.dtype,
            isinstance(value, torch.nn.Parameter),
            value.requires_grad,
        )
    return value


def pack_graph(gm: fx.GraphModule) -> dict:
    """``gm``'s nodes, code generator and attributes, picklable, for :func:`unpack_graph`; CPU stages only."""
    nodes = [
        (n.op, n.name, _target_name(n.target), _encode(n.args), _encode(n.kwargs), n.type)
        for n in gm.graph.nodes
    ]
    attributes = {n.target: _sent(attrgetter(n.target)(gm)) for n in gm.graph.nodes if n.op == "get_attr"}
    return {"nodes": nodes, "attributes": attributes, "codegen": gm.graph._codegen}


def unpack_graph(packed: dict) -> fx.GraphModule:
    """The GraphModule :func:`pack_graph` described: the same nodes under the same names, so the same code."""
    graph = fx.Graph()
    graph._codegen = packed["codegen"]
    nodes: dict = {}
    for op, name, target, args, kwargs, type_expr in packed["nodes"]:
        node = graph.create_node(
            op, _target(target), _decode(args, nodes), _decode(kwargs, nodes), name=name, type_expr=type_expr
        )
        if node.name != name:
            raise ValueError(f"FX node {name!r} came back as {node.name!r}")
        nodes[name] = node
    attributes = {k: v.make() if isinstance(v, EmptyTensor) else v for k, v in packed["attributes"].items()}
    return fx.GraphModule(attributes, graph)
