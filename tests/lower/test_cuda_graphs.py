"""CUDA graphs over fixed-shape stages: the option, the pass-through, and the CUDA branch's logic
(signatures, static buffers, warm-up, capture, replay, fallback, eviction) on CPU through a fake
``torch.cuda`` (tests/lower/fake_cuda.py). A real capture needs a GPU; these tests do not."""

import logging

import pytest
import torch

from saguaro.core.config import SaguaroConfig
from saguaro.core.errors import ConfigError
from saguaro.core.stages import STAGES, TARGET_PREFILL, TARGET_SCORE
from saguaro.lower import cuda_graphs
from saguaro.lower.cuda_graphs import GraphedStage, captures_stage, resolve_cuda_graphs
from saguaro.lower.lowering import CompiledStage, lower_graph
from tests.lower.fake_cuda import FakeCuda


@pytest.mark.parametrize("value", ["auto", True, False])
def test_config_accepts_auto_true_false_and_defaults_to_auto(value):
    assert SaguaroConfig(cuda_graphs=value).cuda_graphs is value
    assert SaguaroConfig().cuda_graphs == "auto"


@pytest.mark.parametrize("value", [1, 0, "on", None, "AUTO"])
def test_config_refuses_other_values(value):
    with pytest.raises(
        ConfigError, match=rf"cuda_graphs={value!r} is not allowed: choose 'auto', True or False"
    ):
        SaguaroConfig(cuda_graphs=value)


def test_auto_is_on_on_cuda_only_and_follows_the_switch(monkeypatch):
    assert cuda_graphs.CUDA_GRAPHS_AUTO is True  # the probe found every stage host-bound on an H200
    assert resolve_cuda_graphs("auto", "cuda:0") is True
    assert resolve_cuda_graphs("auto", torch.device("cuda", 1)) is True
    assert resolve_cuda_graphs("auto", "cpu") is False  # never off CUDA
    assert resolve_cuda_graphs(False, "cuda:0") is False  # False turns it off
    monkeypatch.setattr(cuda_graphs, "CUDA_GRAPHS_AUTO", False)
    assert resolve_cuda_graphs("auto", "cuda:0") is False


def test_true_off_cuda_is_a_config_error_naming_the_device():
    assert resolve_cuda_graphs(True, "cuda") is True and resolve_cuda_graphs(False, "cuda") is False
    assert resolve_cuda_graphs(False, "cpu") is False
    with pytest.raises(
        ConfigError, match=r"cuda_graphs=True needs the models on a CUDA device, but they are on cpu"
    ):
        resolve_cuda_graphs(True, torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"cuda_graphs='yes' is not allowed"):
        resolve_cuda_graphs("yes", "cuda")


def test_every_stage_but_prefill_and_score_is_captured():
    captured = {s for s in STAGES if captures_stage(s)}
    assert captured == {s for s in STAGES if s.family not in (TARGET_PREFILL.family, TARGET_SCORE.family)}
    assert len(captured) == len(STAGES) - 3  # the target's and the draft's prefill, the target's score


def _graph_module():
    graph = torch.fx.Graph()
    x, cache = graph.placeholder("x"), graph.placeholder("cache")
    graph.call_method("copy_", (cache, x))
    graph.output((graph.call_function(torch.mul, (x, 2)),))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_lower_graph_wraps_stages_in_graphs_only_on_cuda():
    gm = _graph_module()
    assert lower_graph(gm, "eager", "draft.test", "cuda") is gm  # off by default
    eager = lower_graph(gm, "eager", "draft.test", "cuda", cuda_graphs=True)
    assert isinstance(eager, GraphedStage) and eager.fn is gm and eager.fixed == {1}
    inductor = lower_graph(
        gm, "inductor", "draft.test", "cuda", cuda_graphs=True
    )  # compiles on first call only
    assert isinstance(inductor, CompiledStage) and isinstance(inductor.compiled, GraphedStage)
    assert inductor.compiled.fixed == {1} and inductor.compiled.name == "draft.test"
    for backend in ("eager", "inductor"):
        with pytest.raises(ConfigError, match=r"needs a CUDA device, but stage draft\.test runs on cpu"):
            lower_graph(gm, backend, "draft.test", "cpu", cuda_graphs=True)


def test_inputs_off_the_device_pass_through(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: pytest.fail("no graph may be made for CPU inputs"))
    calls = []
    stage = GraphedStage(
        lambda *a: calls.append(a) or (a[0] + 1,), "draft.test", fixed=(1,)
    )  # device_type cuda
    x, cache = torch.ones(2), torch.zeros(2)
    for _ in range(3):
        (out,) = stage(x, cache)
        assert torch.equal(out, x + 1)
    assert all(c[0] is x and c[1] is cache for c in calls) and stage.counts["passed"] == 3
    assert stage.signature((1.0, 2)) is None  # no tensor at all
    assert (
        GraphedStage(lambda *a: a, "x", device_type="cpu").signature((torch.ones(1), [1])) is None
    )  # unhashable


def cache_stage(cuda: FakeCuda, log: list):
    """A stage with CUDA's launch semantics: writes ``x`` into ``cache`` in place, returns ``2x + scale``."""

    def stage(x, cache, scale):
        log.append((x, cache))
        out = torch.empty_like(x)  # in a real capture: the graph's private pool

        def kernel():
            cache[: x.shape[0]].copy_(x)
            out.copy_(x * 2 + scale)

        cuda.launch(kernel)
        return (out,)

    return stage


def test_warm_up_then_capture_then_replay_with_static_buffers(monkeypatch):
    cuda = FakeCuda().install(monkeypatch)
    log = []
    stage = GraphedStage(cache_stage(cuda, log), "draft.test", fixed=(1,), device_type="cpu")
    cache = torch.zeros(4)
    xs, outs = [], []
    for step in range(4):
        x = torch.full((3,), float(step + 1))
        (out,) = stage(x, cache, 0.5)
        assert torch.equal(out, x * 2 + 0.5) and torch.equal(cache[:3], x)  # each call's own inputs
        xs.append(x)
        outs.append(out)
    # 1st call: warm-up on the side stream; 2nd: capture (nothing runs), replay and check it against the
    # stage run without the graph; then replays only
    assert stage.counts == {
        "passed": 0,
        "warmups": 1,
        "captures": 1,
        "replays": 3,
        "failed": 0,
        "evicted": 0,
        "checks": 1,
        "mismatches": 0,
        "enclosed": 0,
    }
    assert len(log) == 3, (
        "the stage itself runs only to warm up, to be captured and for the first replay's check"
    )
    static_x = log[0][0]
    assert log[1][0] is static_x and static_x is not xs[0] and static_x is not xs[1]  # a static buffer
    assert log[0][1] is cache and log[1][1] is cache  # written in place: never copied
    assert log[2][0] is static_x and log[2][1] is not cache, "the check writes a copy of the cache"
    assert stage.graphs_off is None
    assert [out[0].item() for out in outs] == [2.5, 4.5, 6.5, 8.5], "outputs are clones, not the static ones"
    assert cuda.capture_kwargs[0]["capture_error_mode"] == "thread_local"
    assert cuda.capture_kwargs[0]["stream"] is stage._streams[torch.device("cpu")]
    assert cuda.events[:5] == [
        ("wait", "side", "current"),
        ("stream", "side"),
        ("wait", "current", "side"),
        ("device", "cpu"),
        ("capture", cuda.events[4][1], "side"),
    ]


def test_signature_separates_shapes_constants_addresses_and_modes(monkeypatch):
    cuda = FakeCuda().install(monkeypatch)
    stage = GraphedStage(cache_stage(cuda, []), "draft.test", fixed=(1,), device_type="cpu")
    cache = torch.zeros(4)
    base = stage.signature((torch.ones(3), cache, 0.5))
    assert base == stage.signature((torch.zeros(3), cache, 0.5))  # values of copied inputs do not count
    assert base != stage.signature((torch.ones(2), cache, 0.5))  # shape
    assert base != stage.signature((torch.ones(3, dtype=torch.float64), cache, 0.5))  # dtype
    assert base != stage.signature((torch.ones(3), torch.zeros(4), 0.5))  # a cache at another address
    assert base != stage.signature((torch.ones(3), cache, 1.0))  # a constant baked into the graph
    with torch.inference_mode():
        assert base != stage.signature((torch.ones(3), cache, 0.5))
    meta = torch.empty(3, device="meta")
    assert stage.signature((torch.ones(3), meta, 0.5)) is None  # another device type


def test_each_signature_has_its_own_graph_and_the_oldest_is_evicted(monkeypatch):
    cuda = FakeCuda().install(monkeypatch)
    stage = GraphedStage(cache_stage(cuda, []), "draft.test", fixed=(1,), device_type="cpu", max_graphs=2)
    caches = [torch.zeros(4) for _ in range(3)]
    for cache in caches:  # three stores: three signatures, each warmed up then captured
        for value in (1.0, 2.0):
            (out,) = stage(torch.full((2,), value), cache, 0.0)
            assert torch.equal(out, torch.full((2,), 2 * value)) and torch.equal(
                cache[:2], torch.full((2,), value)
            )
    assert stage.counts["captures"] == 3 and stage.counts["evicted"] == 1
    (out,) = stage(torch.full((2,), 5.0), caches[2], 0.0)  # still held: a replay
    assert stage.counts["replays"] == 4 and out[0].item() == 10.0
    stage(torch.full((2,), 5.0), caches[0], 0.0)  # evicted: warmed up again
    assert stage.counts["warmups"] == 4


def test_a_failed_capture_falls_back_to_the_stage_for_that_signature(monkeypatch, caplog):
    cuda = FakeCuda().install(monkeypatch)
    cuda.fail_capture = True
    log = []
    stage = GraphedStage(cache_stage(cuda, log), "draft.test", fixed=(1,), device_type="cpu")
    cache = torch.zeros(4)
    with caplog.at_level(logging.WARNING, logger="saguaro.lower.cuda_graphs"):
        results = [stage(torch.full((2,), v), cache, 0.0)[0] for v in (1.0, 2.0, 3.0)]
    assert [r[0].item() for r in results] == [2.0, 4.0, 6.0] and torch.equal(cache[:2], torch.full((2,), 3.0))
    assert stage.counts["failed"] == 1 and stage.counts["passed"] == 2 and stage.counts["captures"] == 0
    assert len(cuda.capture_kwargs) == 1, "a signature whose capture failed is not captured again"
    assert torch.device("cpu") not in stage._streams, "a failed capture's side stream is not used again"
    assert log[-1][0] is not None and log[-1][1] is cache
    assert "stage draft.test: CUDA graph capture failed (RuntimeError: operation not permitted" in caplog.text
    assert (
        stage.graphs_off
        == "capture failed for 1 shape(s): RuntimeError: operation not permitted when stream "
        "is capturing"
    )


def test_record_stream_is_skipped_for_tensors_off_cuda(monkeypatch):
    cuda = FakeCuda().install(monkeypatch)
    stage = GraphedStage(lambda x: [x * 3, (x + 1,), "label"], "draft.test", device_type="cpu")
    out = stage(torch.ones(2))  # a warm-up returns the stage's own (nested) outputs
    assert torch.equal(out[0], torch.full((2,), 3.0)) and out[2] == "label"
    again = stage(torch.ones(2))  # captured then replayed: clones keep the container types
    assert (
        isinstance(again, list)
        and isinstance(again[1], tuple)
        and torch.equal(again[1][0], torch.full((2,), 2.0))
    )
    assert again[2] == "label" and cuda.capturing is None


def test_tensor_parallel_targets_graph_only_when_asked(monkeypatch):
    """All-reduces inside captured graphs have not run on GPUs: ``"auto"`` is off on tensor-parallel ranks."""
    import importlib
    from types import SimpleNamespace

    import saguaro.runtime.tensor_parallel as tensor_parallel
    from tests.models import tiny_target

    compile_module = importlib.import_module(
        "saguaro.compile"
    )  # the module (saguaro.compile is the function)
    ranks = SimpleNamespace(is_draft=False, rank=0, target_group=SimpleNamespace(group_name="g"))
    seen = []
    monkeypatch.setattr(tensor_parallel, "join_ranks", lambda n, device: ranks)
    monkeypatch.setattr(tensor_parallel, "TensorParallelProgram", lambda program, ranks: program)
    monkeypatch.setattr(compile_module, "compile_program", lambda t, d, cfg, shard: seen.append(cfg))
    target = tiny_target("llama")
    for asked in ("auto", True, False):
        compile_module.compile_tensor_parallel(
            target, None, SaguaroConfig(tensor_parallel=2, cuda_graphs=asked)
        )
    assert [cfg.cuda_graphs for cfg in seen] == [False, True, False]
    assert all(cfg.sd_when_faster is False for cfg in seen)


def test_compiled_builders_graph_functions_of_several_stages_only_under_cuda_graphs():
    from saguaro.compile import CompiledStages

    builder = CompiledStages.__new__(CompiledStages)
    builder.cuda_graphs = False
    assert builder.graphed(lambda *a: a, "sd round", range(3)) is None
    builder.cuda_graphs = True
    graphs = builder.graphed(lambda *a: a, "sd round", range(3))
    assert isinstance(graphs, GraphedStage) and graphs.fixed == {0, 1, 2} and graphs.name == "sd round"
    assert graphs.device_type == "cuda" and graphs._run is not graphs.fn  # its stages run inside it
