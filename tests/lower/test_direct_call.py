"""Direct calls (``saguaro/lower/direct_call.py``): which recorded calls give a direct call, and that it rebuilds
the inputs dynamo gave Inductor's function from a later call's arguments. Entries here are stand-ins (no
compile); ``test_inductor.py`` runs the real ones and checks the tokens, and the last test here one real
``torch.compile`` of a small function."""

import functools

import pytest
import torch
from torch._inductor.output_code import CompiledFxGraph

from saguaro.lower.direct_call import (
    CompiledEntry,
    DirectCall,
    RecordingInductor,
    direct_call,
    held_tensors,
    inductor_graph,
    record_inner_calls,
    recording,
)

PLAIN = ((None, None), (None, None))  # a tensor input of static sizes and strides


class Entry:
    """A stand-in for a CompiledEntry: ``inputs`` as input_symbols gives them, ``compiled`` records its inputs."""

    int_tensors = False

    def __init__(self, inputs):
        self.inputs, self.seen = inputs, []

    def compiled(self, *inputs):
        self.seen.append(inputs)
        return [inputs[1] + 1, inputs[1] * 2]


def scenario():
    """A stage of arguments ``(x [2, 3], cache [2, S])`` holding ``weight``; dynamo passed ``(weight, x, S,
    cache)``, ``S`` being the cache's dynamic size ``s0``."""
    weight, x, cache = torch.ones(3), torch.zeros(2, 3), torch.zeros(2, 5)
    entry = Entry([PLAIN, PLAIN, "s0", ((None, "s0"), ("s0", None))])
    inputs = (weight, x, 5, cache)
    raw = entry.compiled(*inputs)
    return entry, (x, cache), inputs, raw, {id(weight): weight}


def test_a_direct_call_rebuilds_the_inputs_of_later_calls():
    entry, args, inputs, raw, held = scenario()
    call = direct_call([(entry, inputs, raw, None)], args, tuple(raw), held)
    assert isinstance(call, DirectCall)
    assert call.sources[0][0] == 1 and call.sources[1] == (0, 0) and call.sources[2] == (2, (1, 1))
    x, cache = torch.full((2, 3), 4.0), torch.zeros(2, 7)  # another bucket: the size comes from the argument
    out = call((x, cache))
    assert isinstance(out, tuple) and torch.equal(out[0], x + 1) and torch.equal(out[1], x * 2)
    weight, seen_x, size, seen_cache = entry.seen[-1]
    assert weight is inputs[0] and seen_x is x and size == 7 and seen_cache is cache


def test_a_symbol_found_only_in_a_stride_is_read_from_the_stride():
    entry, args, inputs, raw, held = scenario()
    entry.inputs[3] = ((None, None), ("s0", None))  # s0 only as the cache's first stride (5)
    call = direct_call([(entry, inputs, raw, None)], args, tuple(raw), held)
    assert call is not None and call.sources[2] == (3, (1, 0))


@pytest.mark.parametrize(
    "case",
    [
        "two calls",
        "unknown tensor",
        "int without symbol",
        "symbol nowhere",
        "outputs changed",
        "outputs not a tuple",
        "rebuilt differs",
    ],
)
def test_calls_that_cannot_be_rebuilt_keep_dynamos_path(case):
    entry, args, inputs, raw, held = scenario()
    out, copies = tuple(raw), 1
    if case == "two calls":
        copies = 2
    elif case == "unknown tensor":
        held = {}
    elif case == "int without symbol":
        entry.inputs[2] = None
    elif case == "symbol nowhere":
        entry.inputs[2] = "s9"
    elif case == "outputs changed":
        out = (raw[0].clone(), raw[1])
    elif case == "outputs not a tuple":
        out = raw[0]
    elif case == "rebuilt differs":  # dynamo passed 6 where the cache's size says 5
        inputs = (inputs[0], inputs[1], 6, inputs[3])
    assert direct_call([(entry, inputs, raw, None)] * copies, args, out, held) is None


@pytest.mark.parametrize(
    "case", ["passes through", "two inner calls", "other inputs", "other outputs", "none"]
)
def test_the_graphs_own_function_is_called_only_where_the_wrapper_passed_everything_through(case):
    entry, args, inputs, raw, held = scenario()
    entry.boxed = lambda given: [given[1] - 1]  # "Inductor's graph function": its inputs as a list
    inner = [(list(inputs), raw)]
    if case == "two inner calls":
        inner = inner * 2
    elif case == "other inputs":  # the wrapper handed the graph a copy of an input
        inner = [([inputs[0], inputs[1].clone(), inputs[2], inputs[3]], raw)]
    elif case == "other outputs":  # the wrapper returned something else than the graph's outputs
        inner = [(list(inputs), [raw[0], raw[1].clone()])]
    elif case == "none":
        inner = None
    call = direct_call([(entry, inputs, raw, inner)], args, tuple(raw), held)
    assert call is not None
    x, cache = torch.full((2, 3), 4.0), torch.zeros(2, 7)
    if case != "passes through":
        assert call.boxed is None and torch.equal(call((x, cache))[0], x + 1)
        return
    assert call.boxed is entry.boxed
    before = len(entry.seen)
    assert torch.equal(call((x, cache))[0], x - 1) and len(entry.seen) == before  # the graph's function only
    with torch.profiler.profile():  # under the profiler, through the wrapper (whose records it shows)
        assert torch.equal(call((x, cache))[0], x + 1) and len(entry.seen) == before + 1


def test_a_cpp_wrapper_graph_gets_its_integer_inputs_as_the_same_tensors_each_call():
    entry, args, inputs, raw, held = scenario()
    seen = []
    entry.boxed = lambda given: seen.append(list(given)) or [given[1] + 1]
    entry.int_tensors = True  # RecordingInductor with cpp_wrapper
    call = direct_call([(entry, inputs, raw, [(list(inputs), raw)])], args, tuple(raw), held)
    x, cache = torch.zeros(2, 3), torch.zeros(2, 7)
    call((x, cache))
    call((x, cache))
    first, second = seen
    assert first[1] is x and first[3] is cache and first[0] is inputs[0]  # tensors as they are
    assert isinstance(first[2], torch.Tensor) and first[2].dtype == torch.int64 and int(first[2]) == 7
    assert second[2] is first[2]  # one tensor per size, not a new one per call
    assert RecordingInductor({"cpp_wrapper": True}).cpp_wrapper and not RecordingInductor({}).cpp_wrapper


def test_the_inductor_graph_is_found_through_its_wrappers_and_records_its_calls():
    graph = CompiledFxGraph.__new__(CompiledFxGraph)
    graph.compiled_fn_runner = None
    graph.current_callable = lambda inputs: [inputs[0] * 2]

    def inner(
        *args,
    ):  # Inductor's graph behind wrappers: a closure, a partial, __wrapped__, an object's compiled_fn
        return graph.current_callable(list(args))

    class Holder:
        compiled_fn = staticmethod(functools.partial(inner))

    @functools.wraps(inner)
    def outer(*args):
        return Holder.compiled_fn(*args)

    outer.__wrapped__ = Holder()
    assert inductor_graph(outer) is graph and inductor_graph(functools.partial(inner)) is graph
    other = CompiledFxGraph.__new__(CompiledFxGraph)
    other.compiled_fn_runner = None
    assert inductor_graph(lambda: None) is None
    assert inductor_graph((lambda g, o: lambda: (g, o))(graph, other)) is None  # two graphs: none chosen
    own = graph.current_callable
    x = torch.ones(2)
    entry = CompiledEntry(torch.fx.symbolic_trace(lambda x: x), outer)
    assert entry.boxed is own and record_inner_calls(graph) is own  # installed once
    assert torch.equal(entry(x)[0], x * 2)  # not recording: passes through
    with recording() as calls:
        out = entry(x)
    ((recorded_entry, given, raw, inner_calls),) = calls
    assert recorded_entry is entry and raw is out and given == (x,) and len(inner_calls) == 1
    assert inner_calls[0][0][0] is x and inner_calls[0][1] is out


def test_held_tensors_finds_parameters_buffers_and_constants():
    module = torch.nn.Linear(2, 2)
    module.register_buffer("scale", torch.ones(1))
    module.constant = torch.zeros(3)
    held = held_tensors(torch.nn.Sequential(module))
    assert all(held[id(t)] is t for t in (module.weight, module.bias, module.scale, module.constant))


def test_recording_sees_the_calls_of_its_thread_only_inside():
    entry = CompiledEntry(torch.fx.symbolic_trace(lambda x: x + 1), lambda *a: [a[0] + 1])
    entry(torch.ones(1))  # not recording: nothing kept
    with recording() as calls:
        out = entry(torch.ones(1))
    entry(torch.ones(1))
    assert len(calls) == 1 and calls[0][0] is entry and calls[0][2] is out


@pytest.mark.heavy
def test_a_compiled_function_called_directly_gives_dynamos_outputs():
    """One real compile: a function of a tensor with a dynamic size and a held weight, called through dynamo
    once (recorded), then directly on another size, equal to eager."""
    weight = torch.randn(4)
    module = torch.nn.Module()
    module.register_buffer("weight", weight)

    def fn(x):
        return (x * module.weight).sum(-1) + x.shape[0], x.cos()

    compiled = torch._dynamo.optimize(backend=RecordingInductor({}), nopython=True, dynamic=None)(fn)
    x = torch.randn(5, 4)
    torch._dynamo.maybe_mark_dynamic(x, 0)
    with recording() as calls:
        out = compiled(x)
    call = direct_call(calls, (x,), out, held_tensors(module))
    assert call is not None and call.boxed is not None  # Inductor's graph function, past AOT's wrapper
    y = torch.randn(9, 4)
    got = call((y,))
    want = fn(y)
    assert len(got) == 2 and all(torch.allclose(g, w) for g, w in zip(got, want))


def test_a_compiled_stage_learns_a_direct_call_and_can_go_back_through_dynamo(monkeypatch):
    """CompiledStage with stand-ins: "dynamo" hands Inductor's "function" the held weight, the argument and its
    dynamic size; the stage's second call of the shape calls the function directly, under other global state
    (autocast) or with ``direct_calls`` off (or ``SAGUARO_DIRECT_CALLS=0`` when the stage is made) through
    dynamo again."""
    from saguaro.lower.lowering import CompiledStage

    module = torch.nn.Module()
    module.register_buffer("weight", torch.full((3,), 2.0))
    gm = torch.fx.symbolic_trace(lambda x: x)
    gm.register_buffer("weight", module.weight)
    entry = CompiledEntry.__new__(CompiledEntry)
    entry.inputs = [PLAIN, (("s0", None), (None, None)), "s0"]
    entry.compiled = lambda weight, x, n: [x * weight + n]
    through_dynamo = []

    def dynamo(x):
        through_dynamo.append(x)
        return tuple(entry(gm.weight, x, x.shape[0]))

    stage = CompiledStage(gm, dynamo, "toy")
    x = torch.ones(4, 3)
    first = stage(x)
    second = stage(x)
    assert len(through_dynamo) == 1 and stage.direct_keys == 1
    assert torch.equal(first[0], second[0]) and torch.equal(second[0], torch.full((4, 3), 6.0))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # global state dynamo guards on, outside the key
        stage(x)
    assert len(through_dynamo) == 2
    stage(x)
    assert len(through_dynamo) == 2  # back in the recorded state: direct again
    stage.direct_calls = False
    stage(x)
    assert len(through_dynamo) == 3
    monkeypatch.setenv("SAGUARO_DIRECT_CALLS", "0")
    off = CompiledStage(gm, dynamo, "toy")
    off(x)
    off(x)
    assert len(through_dynamo) == 5 and off.direct_keys == 0
