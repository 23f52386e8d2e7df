"""The capture cache: a second model of the same architecture reuses the capture, bound to its own
weights (its logits, not the first model's), the cache keeps no weights, and anything that can change
the forward (a module attribute, a hook, the configuration) captures afresh. On disk: a later process
reads the graph instead of exporting; a damaged or foreign entry, or a folder it cannot write, only
costs a fresh capture."""

import copy
import gc
import json
import logging
import weakref

import pytest
import torch

from saguaro.capture.capture_cache import CAPTURES, CaptureCache
from saguaro.capture.export import CapturedModel, capture, example_inputs
from tests.models import tiny_target


@pytest.fixture
def cache(monkeypatch):
    """The process's cache, emptied before and after (other tests' captures stay out of the count); the
    disk cache off (the ``disk`` fixture turns it on in a folder of its own)."""
    monkeypatch.setenv("SAGUARO_CAPTURE_CACHE", "0")
    CAPTURES.clear()
    yield CAPTURES
    CAPTURES.clear()


def other_weights(model, seed):
    twin = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in twin.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
    return twin


def logits(captured):
    ids, *rest = example_inputs(captured.spec)
    ids = torch.randint(
        captured.spec.vocab_size, ids.shape, generator=torch.Generator().manual_seed(0)
    )  # [B, T]
    return captured.graph_module(ids, *rest)  # [B, T, V]


def test_a_twin_reuses_the_capture_bound_to_its_own_weights(cache):
    first = tiny_target("llama")
    twin = other_weights(first, seed=1)
    captured_first = capture(first)
    hits = cache.hits
    reused = capture(twin)
    assert cache.hits == hits + 1
    cache.clear()
    fresh = capture(twin)
    assert cache.hits == hits + 1  # cleared: captured afresh
    assert torch.equal(logits(reused), logits(fresh))
    assert not torch.equal(logits(reused), logits(captured_first))  # the twin's weights, not the first's
    twin_weights = {id(p) for p in twin.parameters()}
    assert {id(p) for p in reused.graph_module.parameters()} <= twin_weights


def test_the_cache_keeps_no_weights_and_no_model_alive(cache):
    model = tiny_target("llama")
    capture(model)
    template = next(iter(cache._templates.values()))
    assert all(t.device.type == "meta" for t in template.parameters())
    assert all(t.device.type == "meta" for t in template.buffers())
    alive = weakref.ref(next(model.parameters()))
    del model
    gc.collect()
    assert alive() is None


def test_what_can_change_the_forward_captures_afresh(cache):
    first = tiny_target("llama")
    capture(first)

    def attribute(model):
        model.model.norm.variance_epsilon = 1.0  # a plain float the forward reads

    def hook(model):
        model.model.layers[1].mlp.register_forward_hook(lambda module, args, out: out * 2)

    def config(model):
        model.config.rms_norm_eps = 1e-3

    for seed, change in enumerate((attribute, hook, config, lambda model: model.to(torch.float64))):
        other = other_weights(first, seed=2 + seed)
        change(other)
        hits = cache.hits
        captured = capture(other)
        assert cache.hits == hits, change
        if change is attribute:  # the fresh capture computes with the new epsilon, the cached one would not
            same_weights = other_weights(first, seed=2)
            reused = CapturedModel(cache.get(*keyed(same_weights)), captured.spec)
            assert not torch.equal(logits(captured), logits(reused))


def keyed(model):
    """``(key, wrapper)`` for ``CaptureCache.get`` of ``model`` (as ``capture`` computes them)."""
    from saguaro.capture.capture_cache import fingerprint
    from saguaro.capture.export import _StageForward, model_spec

    spec = model_spec(model)
    return fingerprint(model, False), _StageForward(model, spec)


def test_least_recently_used_templates_are_dropped():
    cache = CaptureCache(entries=2)
    graph = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    for key in ("a", "b", "a", "c"):  # "a" used again before "c" arrives: "b" goes
        cache.put((key,), graph)
    assert list(cache._templates) == [("a",), ("c",)]
    assert cache.get(("b",), torch.nn.Linear(2, 2)) is None


@pytest.fixture
def disk(cache, tmp_path, monkeypatch):
    """A folder of its own for the captures kept on disk."""
    monkeypatch.setenv("SAGUARO_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SAGUARO_CAPTURE_CACHE", raising=False)
    return tmp_path / "captures"


def no_export(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("torch.export ran")

    monkeypatch.setattr(torch.export, "export", refuse)


def test_a_later_process_reads_the_capture_from_disk_bound_to_its_weights(disk, cache, monkeypatch):
    first = tiny_target("llama")
    twin = other_weights(first, seed=3)
    capture(first)
    assert len([p for p in disk.iterdir() if not p.name.startswith(".")]) == 1  # one entry, no leftovers
    cache.clear()  # as a new process would start
    with monkeypatch.context() as patch:
        no_export(patch)
        from_disk = capture(twin)
    monkeypatch.setenv("SAGUARO_CAPTURE_CACHE", "0")
    cache.clear()
    fresh = capture(twin)
    assert torch.equal(logits(from_disk), logits(fresh))
    assert {id(p) for p in from_disk.graph_module.parameters()} <= {id(p) for p in twin.parameters()}


def test_a_foreign_or_damaged_entry_is_a_miss(disk, cache, caplog, monkeypatch):
    model = tiny_target("llama")
    capture(model)
    (entry,) = disk.iterdir()
    described = json.loads((entry / "entry.json").read_text())
    (entry / "entry.json").write_text(json.dumps({**described, "fingerprint": "another model"}))
    for damage in ("another fingerprint", "could not read"):
        cache.clear()
        exports = []
        with (
            monkeypatch.context() as patch,
            caplog.at_level(logging.INFO, logger="saguaro.capture.capture_files"),
        ):
            export = torch.export.export
            patch.setattr(torch.export, "export", lambda *a, **k: exports.append(1) or export(*a, **k))  # noqa: B023
            captured = capture(other_weights(model, seed=4))
        assert exports == [1] and len(captured.graph_module.graph.nodes) > 0  # captured afresh
        assert damage in caplog.text
        (entry / "entry.json").write_text(json.dumps(described))  # the right fingerprint, ...
        (entry / "graph.json").write_text("not a graph")  # ... a damaged graph


def test_an_unwritable_cache_folder_only_warns(cache, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv("SAGUARO_CACHE_DIR", str(blocker))
    monkeypatch.delenv("SAGUARO_CAPTURE_CACHE", raising=False)
    with caplog.at_level(logging.WARNING, logger="saguaro.capture.capture_files"):
        captured = capture(tiny_target("llama"))
    assert captured.spec.num_layers == 2
    assert "could not keep the capture on disk" in caplog.text
