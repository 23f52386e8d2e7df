"""Which inputs a stage graph writes in place (the KV caches): a CUDA graph keeps those at their addresses.

An input is written when: an op's schema marks the argument ``Tensor(a!)``; a ``foo_`` method, ``out=``,
``setitem`` or ``+=`` writes it or a view of it; a function called as one node names it in
``mutates_args``; or it is a ``k_caches`` / ``v_caches`` input (the stage-graph contract, which covers
``lower_attention``'s ``inline`` and ``flex`` nodes: opaque functions that declare nothing).
"""

from __future__ import annotations

import inspect
import operator
import re

import torch

CACHE_INPUT = re.compile(r"[kv]_caches(_\d+)?")  # the flat signature's per-layer cache placeholders

# methods and functions whose result may share the first argument's storage: a write to the result is
# a write to that argument (anything unlisted is a new tensor, or not a tensor)
VIEW_METHODS = frozenset(
    {
        "view",
        "view_as",
        "reshape",
        "reshape_as",
        "__getitem__",
        "select",
        "narrow",
        "transpose",
        "permute",
        "unsqueeze",
        "squeeze",
        "expand",
        "expand_as",
        "flatten",
        "unflatten",
        "as_strided",
        "t",
        "T",
        "mT",
        "diagonal",
        "unfold",
        "movedim",
        "swapaxes",
        "contiguous",
        "detach",
        "unbind",
        "split",
        "chunk",
        "real",
        "imag",
        "view_as_real",
        "view_as_complex",
        "to",
        "type",
        "type_as",
        "float",
        "double",
        "half",
        "bfloat16",
        "long",
        "int",
        "bool",  # self when unchanged
    }
)

# x += y on tensors, as symbolic tracing records it
IN_PLACE_OPERATORS = frozenset(
    {
        operator.iadd,
        operator.isub,
        operator.imul,
        operator.itruediv,
        operator.ifloordiv,
        operator.imod,
        operator.ipow,
        operator.iand,
        operator.ior,
        operator.ixor,
        operator.ilshift,
        operator.irshift,
        operator.imatmul,
    }
)


def _name(target) -> str:
    """A call's target as a name: ``"index_put_"`` for ``torch.Tensor.index_put_`` or the method string."""
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverloadPacket):  # (an overload is read by its schema)
        return target._qualified_op_name.split("::")[-1]
    return getattr(target, "__name__", "")


def _schema(target):
    if isinstance(target, torch._ops.OpOverload):
        return target._schema
    if isinstance(target, torch._ops.OpOverloadPacket) and target.overloads() == ["default"]:
        return target.default._schema
    return None


def _writes(node: torch.fx.Node) -> list:
    """The argument nodes ``node`` writes in place."""
    if node.op not in ("call_function", "call_method"):
        return []
    schema = _schema(node.target) if node.op == "call_function" else None
    if schema is not None:  # an op with a schema says what it writes: Tensor(a!)
        written = []
        for i, argument in enumerate(schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                value = node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)
                written.append(value)
        return written
    if node.op == "call_function" and (node.target is operator.setitem or node.target in IN_PLACE_OPERATORS):
        return [node.args[0]]
    if node.op == "call_function" and getattr(node.target, "__module__", None) in ("operator", "_operator"):
        return []  # a & b, a | b: operator.and_ / or_ end in "_" but write nothing
    declared = getattr(node.target, "mutates_args", None) if node.op == "call_function" else None
    if declared:  # a Python function called as one node says what it writes
        bound = inspect.signature(node.target).bind_partial(*node.args, **node.kwargs)
        return [bound.arguments[name] for name in declared if name in bound.arguments]
    name = _name(node.target)
    written = [node.args[0]] if name.endswith("_") and not name.startswith("__") and node.args else []
    if "out" in node.kwargs:  # torch.add(a, b, out=c)
        written.append(node.kwargs["out"])
    return written


def _is_view(node: torch.fx.Node) -> bool:
    if node.op not in ("call_function", "call_method") or not node.args:
        return False
    if node.op == "call_function" and node.target is operator.getitem:
        return True
    schema = _schema(node.target) if node.op == "call_function" else None
    if schema is not None:  # aten.view(Tensor(a) self, ...) -> Tensor(a)
        return any(r.alias_info is not None for r in schema.returns)
    return _name(node.target) in VIEW_METHODS


def _root(value):
    """The placeholder ``value`` is a view of, through view calls, if any."""
    while isinstance(value, torch.fx.Node):
        if value.op == "placeholder":
            return value
        if not _is_view(value):
            return None
        source = value.args[0]
        if isinstance(source, (list, tuple)) and isinstance(value.args[1], int):  # [a, b][0]: a itself
            source = source[value.args[1]]
        value = source
    return None


def mutated_inputs(gm: torch.fx.GraphModule) -> tuple[int, ...]:
    """Positions of the inputs ``gm`` writes in place (module docstring)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    written = {p for p in placeholders if CACHE_INPUT.fullmatch(str(p.target))}
    for node in gm.graph.nodes:
        for value in _writes(node):
            values = value if isinstance(value, (list, tuple)) else (value,)  # Tensor(a!)[] arguments
            for v in values:
                root = _root(v)
                if root is not None:
                    written.add(root)
    return tuple(i for i, p in enumerate(placeholders) if p in written)
