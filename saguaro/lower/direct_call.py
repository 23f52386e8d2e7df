"""Direct calls: a compiled stage's later calls of a shape key run Inductor's function without dynamo.

The first call of a key goes through dynamo under :func:`recording`; where the function's inputs can be
rebuilt from the stage's arguments (each tensor an argument or a held one, each integer an argument's size
or stride; checked on that call) and its outputs come back unchanged, :func:`direct_call` makes a
:class:`DirectCall` (past AOT autograd's wrapper too where it only passes things through), run while
dynamo's ``GlobalStateGuard`` holds as recorded. Same function, same outputs; ``SAGUARO_DIRECT_CALLS=0``
turns it off (docs/measurements/2026-12-03-direct-calls.md).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import types

import torch

DIRECT_CALLS_ENV = "SAGUARO_DIRECT_CALLS"  # "0": every call goes through dynamo (to rule direct calls out)

_recorded = threading.local()  # .calls: a list while this thread records, else absent or None


class RecordingInductor(torch._TorchCompileInductorWrapper):
    """Inductor as ``torch.compile(backend="inductor", options=...)`` runs it, its functions recorded."""

    def __init__(self, options: dict):
        super().__init__(None, options, None)
        self.cpp_wrapper = bool(options.get("cpp_wrapper"))

    def __call__(self, model_, inputs_, **kwargs):
        return CompiledEntry(
            model_, super().__call__(model_, inputs_, **kwargs), int_tensors=self.cpp_wrapper
        )


def compile_with_inductor(gm: torch.fx.GraphModule, options: dict):
    """``gm``'s forward under ``torch.compile`` with Inductor ``options`` (the compile helper's too)."""
    # torch.compile(backend="inductor", options=options), its functions recorded; the weights never change
    # shape: no guards on them
    return torch._dynamo.optimize(
        backend=RecordingInductor(options),
        nopython=True,
        dynamic=None,
        guard_filter_fn=torch.compiler.skip_guard_on_all_nn_modules_unsafe,
    )(gm.forward)


class CompiledEntry:
    """One compiled form: Inductor's function and, per input, its size / stride symbols or its own symbol."""

    boxed = None  # the Inductor graph's own function, when found
    int_tensors = False  # whether that function takes integer inputs as 0-d int64 tensors

    def __init__(self, graph: torch.fx.GraphModule, compiled, int_tensors: bool = False):
        self.compiled = compiled
        # the C++ wrapper's graph function takes integer inputs as tensors too (it makes one of each int)
        self.int_tensors = int_tensors
        self.inputs = [
            input_symbols(node.meta.get("example_value"))
            for node in graph.graph.nodes
            if node.op == "placeholder"
        ]
        inner = inductor_graph(compiled)
        self.boxed = None if inner is None else record_inner_calls(inner)  # the graph's own function

    def __call__(self, *args):
        calls = getattr(_recorded, "calls", None)
        if calls is None:
            return self.compiled(*args)
        _recorded.inner = inner = []
        try:
            out = self.compiled(*args)
        finally:
            _recorded.inner = None
        calls.append((self, args, out, inner if self.boxed is not None else None))
        return out


def inductor_graph(fn):
    """The one ``CompiledFxGraph`` the function ``fn`` wraps (through closures, ``__wrapped__``,
    ``compiled_fn``); None unless exactly one."""
    from torch._inductor.output_code import CompiledFxGraph

    found, seen, todo = [], set(), [fn]
    while todo and len(seen) < 256:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, CompiledFxGraph):
            found.append(obj)
        elif isinstance(obj, functools.partial):
            todo.append(obj.func)
        elif isinstance(obj, types.FunctionType):
            for cell in obj.__closure__ or ():
                with contextlib.suppress(ValueError):  # an empty cell
                    todo.append(cell.cell_contents)
            if getattr(obj, "__wrapped__", None) is not None:
                todo.append(obj.__wrapped__)
        elif callable(getattr(obj, "compiled_fn", None)):  # AOT autograd's wrapper objects
            todo.append(obj.compiled_fn)
    return found[0] if len(found) == 1 else None


def record_inner_calls(graph):
    """Route ``graph``'s calls through a recorder of their inputs and outputs (inside a recorded call);
    returns the graph's own function (it takes its inputs as a list, and empties it)."""
    own = graph.current_callable
    if hasattr(own, "records_for"):  # recorded already (another entry of the same graph)
        return own.records_for

    def current_callable(inputs):
        sink = getattr(_recorded, "inner", None)
        if sink is None:
            return own(inputs)
        given = list(inputs)
        out = own(inputs)
        sink.append((given, out))
        return out

    current_callable.records_for = own
    graph.current_callable = current_callable
    return own


def input_symbols(value):
    """A tensor's ``(sizes, strides)`` symbol names (None where static); an integer's symbol name or None."""
    if isinstance(value, torch.Tensor):
        return tuple(symbol_name(s) for s in value.shape), tuple(symbol_name(s) for s in value.stride())
    return symbol_name(value)


def symbol_name(value):
    return str(value.node.expr) if isinstance(value, torch.SymInt) else None


def direct_calls_wanted() -> bool:
    return os.environ.get(DIRECT_CALLS_ENV, "1") != "0"


@contextlib.contextmanager
def recording():
    """Yields the ``(entry, inputs, outputs, inner)`` of the compiled calls this thread makes inside
    (``inner``: the Inductor graph's ``(inputs, outputs)``, None where not found)."""
    previous = getattr(_recorded, "calls", None)
    _recorded.calls = calls = []
    try:
        yield calls
    finally:
        _recorded.calls = previous


class DirectCall:
    """``entry``'s function on inputs rebuilt from a stage call's arguments by ``sources``: per input
    ``(0, position)`` an argument, ``(1, tensor)`` a held tensor, ``(2 | 3, (position, dim))`` a size / a
    stride."""

    def __init__(self, entry: CompiledEntry, sources: list, boxed=None):
        self.compiled, self.sources = entry.compiled, sources
        self.boxed = boxed  # Inductor's graph function, when the wrapper around it only passes things through
        self._int_tensors = {} if boxed is not None and entry.int_tensors else None  # {int: 0-d tensor}
        # the held tensors in place once; per call only the arguments and the integers are filled in
        self._template = [s if kind == 1 else None for kind, s in sources]
        self._arguments = [(j, s) for j, (kind, s) in enumerate(sources) if kind == 0]
        self._sizes = [(j, *s) for j, (kind, s) in enumerate(sources) if kind == 2]
        self._strides = [(j, *s) for j, (kind, s) in enumerate(sources) if kind == 3]
        # the global state dynamo guards on besides what the shape key holds (autocast, deterministic
        # algorithms, ...), as it was at the recorded call: a call made in another state goes through dynamo
        self.state = torch._C._dynamo.guards.GlobalStateGuard()

    def applies(self) -> bool:
        """Whether this thread's global state is the recorded call's."""
        return self.state.check()

    def inputs(self, args) -> list:
        inputs = self._template.copy()
        for j, i in self._arguments:
            inputs[j] = args[i]
        for j, i, dim in self._sizes:
            inputs[j] = args[i].size(dim)
        for j, i, dim in self._strides:
            inputs[j] = args[i].stride(dim)
        return inputs

    def boxed_inputs(self, args) -> list:
        """The inputs of Inductor's graph function (``boxed``) for a stage call's ``args``."""
        inputs = self.inputs(args)
        if self._int_tensors is not None:  # the same 0-d tensor for a size each call, not a new one
            for j, _, _ in (*self._sizes, *self._strides):
                inputs[j] = self._int_tensor(inputs[j])
        return inputs

    def __call__(self, args) -> tuple:
        if self.boxed is not None and not torch.autograd.profiler._is_profiler_enabled:
            return tuple(
                self.boxed(self.boxed_inputs(args))
            )  # (the profiler's records come from the wrapper)
        return tuple(self.compiled(*self.inputs(args)))

    def _int_tensor(self, value: int) -> torch.Tensor:
        held = self._int_tensors.get(value)
        if held is None:
            held = self._int_tensors[value] = torch.tensor(value, dtype=torch.int64)
        return held


def direct_call(calls: list, args: tuple, out, held: dict) -> DirectCall | None:
    """The :class:`DirectCall` for later calls like this one (``args`` in, ``out`` out, ``calls`` recorded,
    ``held`` ``{id: tensor}`` of the module's tensors); None where the inputs cannot be rebuilt."""
    if len(calls) != 1:
        return None
    entry, inputs, raw, inner = calls[0]
    if len(inputs) != len(entry.inputs) or not returns_own_outputs(out, raw):
        return None
    position = {}
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            position.setdefault(id(a), i)
    sources, symbols = [None] * len(inputs), {}
    for j, (value, info) in enumerate(zip(inputs, entry.inputs)):
        if not isinstance(value, torch.Tensor):
            continue
        if id(value) in position:
            i = position[id(value)]
            sources[j] = (0, i)
            for kind, names in ((2, info[0]), (3, info[1])):
                for dim, name in enumerate(names):
                    if name is not None:
                        symbols.setdefault((name, kind), (i, dim))
        elif held.get(id(value)) is value:
            sources[j] = (1, value)
        else:
            return None
    for j, (value, info) in enumerate(zip(inputs, entry.inputs)):
        if sources[j] is None:
            if (info, 2) in symbols:
                kind = 2  # a size
            elif (info, 3) in symbols:
                kind = 3  # a stride
            else:
                return None
            if type(value) is not int or info is None:
                return None
            sources[j] = (kind, symbols[info, kind])
    passes_through = (
        inner is not None
        and len(inner) == 1
        and same_inputs(inner[0][0], inputs)
        and returns_own_outputs(tuple(raw), inner[0][1])
    )
    call = DirectCall(entry, sources, entry.boxed if passes_through else None)
    if not same_inputs(call.inputs(args), inputs):
        return None
    return call


def same_inputs(given, inputs) -> bool:
    """Whether ``given`` holds the very tensors of ``inputs``, and equal integers, in the same places."""
    return len(given) == len(inputs) and all(
        a is b if isinstance(b, torch.Tensor) else (type(a) is type(b) and a == b)
        for a, b in zip(given, inputs)
    )


def returns_own_outputs(out, raw) -> bool:
    """Whether dynamo's result ``out`` is the compiled function's outputs ``raw``, as a tuple, unchanged."""
    return (
        isinstance(out, tuple)
        and isinstance(raw, (list, tuple))
        and len(out) == len(raw)
        and all(a is b for a, b in zip(out, raw))
    )


def held_tensors(gm: torch.nn.Module) -> dict:
    """``{id: tensor}`` of the parameters, buffers and tensor attributes (FX constants) of ``gm``."""
    held = {id(t): t for t in (*gm.parameters(), *gm.buffers())}
    for module in gm.modules():
        held.update((id(v), v) for v in vars(module).values() if isinstance(v, torch.Tensor))
    return held
