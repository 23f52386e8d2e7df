"""The first replay of every captured graph is compared bit for bit with the stage run without the graph
(on copies of the inputs it writes in place); a difference turns the stage's graphs off, with a warning and
``graphs_off`` saying why. Also: Inductor's dynamic sizes reach the static buffers, so a graphed stage
compiles once for every shape. On CPU, through the fake ``torch.cuda`` (tests/lower/fake_cuda.py)."""

import logging

import pytest
import torch

from saguaro.lower.cuda_graphs import GraphedStage, difference
from saguaro.lower.lowering import lower_graph
from tests.lower.fake_cuda import FakeCuda, Kernelized

# Dynamo reads the real torch.cuda while tracing: the fake one stands in only where there is none (a GPU machine
# runs the real graphs in tests/runtime/test_host_syncs_gpu.py and the probe instead).
NEEDS_NO_CUDA = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the fake torch.cuda conflicts with Dynamo on a real GPU"
)


def writing_stage(cuda: FakeCuda, calls: list, bad_output: bool = False, bad_cache: bool = False):
    """Writes ``x`` into ``cache`` in place and returns ``2x``; the kernels it records while captured are
    off by one in the output and/or the cache, as asked (a graph that replays wrong)."""

    def stage(x, cache):
        calls.append(cache)
        captured = cuda.capturing is not None
        out = torch.empty_like(x)

        def kernel():
            cache[: x.shape[0]].copy_(x + (1 if captured and bad_cache else 0))
            out.copy_(x * 2 + (1 if captured and bad_output else 0))

        cuda.launch(kernel)
        return (out,)

    return stage


def run(stage, cache, values):
    return [stage(torch.full((3,), float(v)), cache)[0] for v in values]


def test_a_matching_first_replay_keeps_replaying_and_each_signature_is_checked_once(monkeypatch, caplog):
    cuda = FakeCuda().install(monkeypatch)
    calls = []
    stage = GraphedStage(writing_stage(cuda, calls), "draft.test", fixed=(1,), device_type="cpu")
    cache, other = torch.zeros(4), torch.zeros(4)
    with caplog.at_level(logging.WARNING, logger="saguaro.lower.cuda_graphs"):
        outs = run(stage, cache, (1, 2, 3, 4)) + run(stage, other, (5, 6, 7))  # two signatures
    assert [o[0].item() for o in outs] == [2, 4, 6, 8, 10, 12, 14]
    assert torch.equal(cache[:3], torch.full((3,), 4.0)) and torch.equal(other[:3], torch.full((3,), 7.0))
    counts = stage.counts
    assert (counts["checks"], counts["mismatches"], counts["captures"], counts["replays"]) == (2, 0, 2, 5)
    assert len(calls) == 6, "per signature: warm-up, capture, the check's ungraphed call; then replays only"
    assert calls[2] is not cache and calls[5] is not other, "the check writes copies, never the caches"
    assert stage.graphs_off is None and "differs" not in caplog.text


def test_a_replay_that_differs_in_an_output_turns_the_stage_off(monkeypatch, caplog):
    cuda = FakeCuda().install(monkeypatch)
    calls = []
    stage = GraphedStage(
        writing_stage(cuda, calls, bad_output=True), "target.verify_greedy", fixed=(1,), device_type="cpu"
    )
    cache = torch.zeros(4)
    with caplog.at_level(logging.WARNING, logger="saguaro.lower.cuda_graphs"):
        outs = run(stage, cache, (1, 2, 3))
    assert [o[0].item() for o in outs] == [2, 4, 6], "the check's call returns the ungraphed outputs"
    assert torch.equal(cache[:3], torch.full((3,), 3.0))
    assert stage.counts["mismatches"] == 1 and stage.counts["checks"] == 1
    assert stage.counts["replays"] == 1 and stage.counts["passed"] == 1, "after the check: the stage itself"
    assert not stage._entries, "the graphs (and their memory) are dropped"
    why = "the first replay of its CUDA graph differs from the stage run without it: output 0 (3,) torch.float32"
    assert stage.graphs_off == why + ": 3 of 3 elements differ"
    assert (
        f"stage target.verify_greedy: {why}" in caplog.text
        and "runs without CUDA graphs from now on" in caplog.text
    )
    run(stage, torch.zeros(4), (4,))  # another signature: no graph either (the whole stage is off)
    assert stage.counts["warmups"] == 1 and stage.counts["passed"] == 2


def test_a_replay_that_differs_in_a_written_input_turns_the_stage_off_and_keeps_the_right_cache(monkeypatch):
    cuda = FakeCuda().install(monkeypatch)
    stage = GraphedStage(writing_stage(cuda, [], bad_cache=True), "draft.test", fixed=(1,), device_type="cpu")
    cache = torch.zeros(4)
    outs = run(stage, cache, (1, 2))
    assert [o[0].item() for o in outs] == [2, 4]
    assert torch.equal(cache, torch.tensor([2.0, 2.0, 2.0, 0.0])), "the ungraphed call's writes stand"
    assert stage.graphs_off.endswith("input 1 (written in place) (4,) torch.float32: 3 of 4 elements differ")


def test_difference_compares_bits_shapes_dtypes_and_counts():
    a = torch.tensor([0.0, float("nan"), 1.0])
    assert difference([a], [a.clone()], ["output 0"]) is None, "the same NaN bits are equal"
    assert (
        difference([a], [torch.tensor([-0.0, float("nan"), 1.0])], ["output 0"])
        == "output 0 (3,) torch.float32: 1 of 3 elements differ"
    )  # -0.0 is another bit pattern
    assert difference([a], [a[:2]], ["x"]) == "x: (3,) torch.float32 instead of (2,) torch.float32"
    assert difference([a], [a.double()], ["x"]) == "x: (3,) torch.float32 instead of (3,) torch.float64"
    assert difference([torch.empty(0)], [torch.empty(0)], ["x"]) is None
    wide = torch.tensor([1, 2], dtype=torch.int64)
    assert (
        difference([wide], [torch.tensor([1, 2 + 2**40])], ["x"])
        == "x (2,) torch.int64: 1 of 2 elements differ"
    )
    assert (
        difference([torch.tensor(True)], [torch.tensor(False)], ["x"])
        == "x () torch.bool: 1 of 1 elements differ"
    )


def test_a_different_number_of_outputs_is_a_difference(monkeypatch):
    cuda = FakeCuda().install(monkeypatch)
    state = {"calls": 0}

    def stage(x):
        state["calls"] += 1
        return (x + 1,) if cuda.capturing is not None else (x + 1, x)

    graphed = GraphedStage(Kernelized(stage, cuda), "draft.test", device_type="cpu")
    for _ in range(2):
        out = graphed(torch.ones(2))
    assert len(out) == 2 and graphed.graphs_off.endswith(
        "its CUDA graph differs from the stage run without it: 1 outputs instead of 2"
    )


@NEEDS_NO_CUDA
def test_dynamic_dims_reach_the_static_buffers_so_one_compile_serves_every_shape(monkeypatch):
    from torch._dynamo.testing import CompileCounter

    cuda = FakeCuda().install(monkeypatch)
    compiles = {}
    for dynamic in (None, {0: (1,)}):
        torch._dynamo.reset()
        counter = CompileCounter()
        compiled = torch.compile(lambda x: (x * 2,), backend=counter, fullgraph=True)
        stage = GraphedStage(
            Kernelized(compiled, cuda), "draft.test", device_type="cpu", dynamic_dims=dynamic
        )
        for width in (5, 7, 9):
            for _ in range(3):  # warm-up (compiles), capture and check, replay
                x = torch.arange(2.0 * width).view(2, width)
                assert torch.equal(stage(x)[0], x * 2)
        compiles[bool(dynamic)] = counter.frame_count
        assert stage.counts["captures"] == 3 and stage.counts["mismatches"] == 0
    torch._dynamo.reset()
    assert compiles == {False: 2, True: 1}, (
        "static: a compile, then dynamo's automatic dynamic one; marked: one"
    )


def test_lowered_inductor_stages_compile_dynamic_under_cuda_graphs_and_report_their_graphs():
    graph = torch.fx.Graph()
    x, cache = graph.placeholder("x"), graph.placeholder("cache")
    graph.call_method("copy_", (cache, x))
    graph.output((graph.call_function(torch.mul, (x, 2)),))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    stage = lower_graph(gm, "inductor", "draft.test", "cuda", cuda_graphs=True, dynamic_dims={0: (0,)})
    assert stage.dynamic_dims == {0: (0,)} and stage.compiled.dynamic_dims == {
        0: (0,)
    }  # one compile, not static
    assert stage.graphs_off is None
    stage.compiled.mismatch = "why"
    assert stage.graphs_off == "why"
    plain = lower_graph(gm, "inductor", "draft.test", "cpu", dynamic_dims={0: (0,)})
    assert plain.graphs_off is None  # not graphed


class _Writes(torch.nn.Module):
    def forward(self, x, cache):  # x [B, T], cache [B, S]: the first T slots written in place
        cache.narrow(1, 0, x.shape[1]).copy_(x)
        return (x * 2 + cache.sum(dim=1, keepdim=True),)


@NEEDS_NO_CUDA
def test_a_graphed_compiled_stage_compiles_once_for_every_bucket_and_captures_per_shape(monkeypatch):
    """CompiledStage (marks the inputs, the written cache among them) around GraphedStage (marks its static
    buffers): three (query length, capacity) buckets, one dynamo compile, three graphs, each checked."""
    from torch._dynamo.testing import CompileCounter

    from saguaro.lower.graph_inputs import mutated_inputs
    from saguaro.lower.lowering import CompiledStage

    cuda = FakeCuda().install(monkeypatch)
    gm = torch.fx.symbolic_trace(_Writes())
    torch._dynamo.reset()
    counter = CompileCounter()
    dims = {0: (1,), 1: (1,)}
    graphs = GraphedStage(
        Kernelized(torch.compile(gm.forward, backend=counter, fullgraph=True), cuda),
        "draft.test",
        mutated_inputs(gm),
        device_type="cpu",
        dynamic_dims=dims,
    )
    stage = CompiledStage(gm, graphs, "draft.test", dims)
    assert graphs.fixed == {1} and not stage.direct_calls
    for length, capacity in ((5, 16), (7, 32), (9, 48)):
        cache = torch.zeros(2, capacity)
        for step in range(3):  # warm-up, capture and check, replay
            x = torch.full((2, length), float(step + 1))
            (out,) = stage(x, cache)
            assert torch.equal(out, x * 2 + (step + 1) * length) and torch.equal(cache[:, :length], x)
    torch._dynamo.reset()
    assert counter.frame_count == 1, "one compile for every bucket"
    assert (graphs.counts["captures"], graphs.counts["checks"], graphs.counts["mismatches"]) == (3, 3, 0)
    assert graphs.counts["replays"] == 6 and stage.graphs_off is None


def test_an_enclosing_stage_runs_its_stages_inside_its_graph_and_without_its_graph_they_keep_theirs(
    monkeypatch,
):
    cuda = FakeCuda().install(monkeypatch)
    inner = GraphedStage(writing_stage(cuda, []), "draft.test", fixed=(1,), device_type="cpu")

    def two_steps(x, cache):  # a function of several stage calls (SD's round), one kernel launched per call
        (y,) = inner(x, cache)
        return inner(y, cache)

    outer = GraphedStage(two_steps, "sd round", fixed=(1,), device_type="cpu", encloses=True)
    cache = torch.zeros(4)
    outs = run(outer, cache, (1, 2, 3))
    assert [o[0].item() for o in outs] == [4, 8, 12] and torch.equal(cache[:3], torch.full((3,), 6.0))
    assert outer.counts["captures"] == 1 and outer.counts["replays"] == 2 and outer.counts["mismatches"] == 0
    # warm-up, capture, check: two calls each, as themselves (the capture recorded their kernels in its graph)
    assert inner.counts["enclosed"] == 6 and inner.counts["captures"] == 0
    outer.mismatch = "turned off"  # without its graph: its stages graph themselves
    run(outer, cache, (4, 5))
    assert inner.counts["enclosed"] == 6 and inner.counts["captures"] == 1 and outer.counts["passed"] == 2
