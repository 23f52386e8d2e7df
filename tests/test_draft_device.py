"""``saguaro.compile(..., draft_device=...)``: the option's checks, the draft on the CPU when the target
is there (the same tokens), and a runner serving callers on another device (stage inputs copied to it,
outputs back). A second CUDA device is not here: that branch of the checks runs with CUDA's device
count faked, and the copies between devices with the meta device standing in for the runner's."""

import types

import pytest
import torch

import saguaro
from saguaro.capture.export import ModelSpec
from saguaro.compile import draft_device
from saguaro.core.config import SaguaroConfig
from saguaro.core.errors import ConfigError
from saguaro.core.stages import DRAFT_STEP
from saguaro.runtime.base import model_runner
from saguaro.runtime.base.model_runner import ModelRunner, RunnerStore
from tests.conftest import tiny_pair
from tests.models import prompts, reference_greedy


@pytest.mark.parametrize(
    "value, why",
    [
        ("meta", "the draft runs on"),
        ("mps", "the draft runs on"),
        ("garbage!", "not a torch device"),
        ("cuda:x", "not a torch device"),
        ("", "not a torch device"),
        (3, "not a torch device"),
        (True, "not a torch device"),
    ],
)
def test_a_draft_device_that_is_not_cpu_or_cuda_is_refused_naming_it(value, why):
    with pytest.raises(
        ConfigError, match=rf"draft_device={value!r} is not allowed: .*{why}.*'cpu', 'cuda' or 'cuda:N'"
    ):
        SaguaroConfig(draft_device=value)


def test_a_torch_device_is_kept_as_its_string():
    assert SaguaroConfig(draft_device=torch.device("cuda", 1)).draft_device == "cuda:1"
    assert SaguaroConfig(draft_device="cpu").draft_device == "cpu" and SaguaroConfig().draft_device is None


def test_a_cpu_target_refuses_a_cuda_draft_device_before_anything_moves():
    target, draft, _ = tiny_pair("llama")
    with pytest.raises(
        ConfigError,
        match=r"draft_device='cuda:0' is not allowed: the target is on cpu.*"
        r"use draft_device=None or 'cpu'",
    ):
        saguaro.compile(target, draft, draft_device="cuda:0", backend="eager")
    assert next(draft.parameters()).device.type == "cpu"


def test_for_a_cuda_target_any_cuda_device_of_the_process_is_allowed(monkeypatch):
    """The CUDA branch of the check, with two CUDA devices faked (nothing is allocated on them)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    target = torch.device("cuda:0")
    assert draft_device("cuda:1", target) == torch.device("cuda:1")
    assert draft_device("cuda", target) == torch.device("cuda:0")
    assert draft_device(None, target) is None
    for bad in ("cuda:2", "cpu"):
        with pytest.raises(
            ConfigError,
            match=rf"draft_device='{bad}' is not allowed: the target is on cuda:0.*"
            r"'cuda:0'..'cuda:1'",
        ):
            draft_device(bad, target)


def test_the_draft_on_the_targets_cpu_gives_the_same_tokens_in_ssd_and_sd():
    target, draft, _ = tiny_pair("llama")
    program = saguaro.compile(
        target,
        draft,
        k=3,
        mode="ssd",
        lane="thread",
        fan_out="geometric",
        backend="eager",
        sd_when_faster=False,
        draft_device="cpu",
    )
    try:
        assert program.config.draft_device == "cpu" and program.draft.spec.device == torch.device("cpu")
        ids, mask = prompts(2, 6, seed=3, pad_rows={1: 2})
        expected = reference_greedy(target, ids, mask, 12)
        for mode in ("ssd", "sd"):
            out = program.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None, mode=mode)
            assert torch.equal(out.sequences, expected), mode
    finally:
        program.close()


def meta_spec() -> ModelSpec:
    return ModelSpec(
        model_class="Tiny",
        num_layers=1,
        num_heads=2,
        num_kv_heads=2,
        head_dim=4,
        vocab_size=16,
        max_positions=32,
        dtype=torch.float32,
        device=torch.device("meta"),
    )


def test_a_runner_store_rolls_back_with_lengths_from_the_callers_device():
    store = RunnerStore(meta_spec(), batch=2, capacity=8)
    store.invalidate_from(torch.tensor([3, 5]))  # on the CPU: copied to the store's device
    assert store.slot_pos.device.type == "meta"


def test_a_runner_on_another_device_copies_a_stage_call_there_and_its_outputs_back(monkeypatch):
    seen = []

    def stage_fn(*args):
        seen.extend(a.device.type for a in args if isinstance(a, torch.Tensor))
        return (torch.empty(2, dtype=torch.long, device="meta"),)

    real = model_runner.to_device

    def to_device(value, device):  # a meta tensor cannot be read back: stands in for the copy back
        if isinstance(value, torch.Tensor) and value.device.type == "meta" and device.type == "cpu":
            return torch.zeros(value.shape, dtype=value.dtype)
        return real(value, device)

    monkeypatch.setattr(model_runner, "to_device", to_device)
    graph = lambda *args: (
        seen.extend(a.device.type for a in args if isinstance(a, torch.Tensor))
        or (torch.empty(2, 1, 16, device="meta"),)
    )
    runner = ModelRunner(
        "draft",
        types.SimpleNamespace(spec=meta_spec(), graph_module=graph),
        build=lambda stage: stage_fn,
        width=4,
    )
    store = runner.new_store(2, 8)
    ids = torch.zeros(2, 1, dtype=torch.long)
    (token,) = runner.run(
        DRAFT_STEP.for_temperature(0.0), store, ids, ids.clone(), ids.clone(), torch.tensor(0.5)
    )
    assert token.device.type == "cpu" and set(seen) == {"meta"} and len(seen) == 5 + 2 + 2 + 1
    assert DRAFT_STEP.for_temperature(0.0).qualified in runner.stage_cost_s
    seen.clear()
    assert runner(store, ids, ids.clone(), ids.clone()).device.type == "cpu" and set(seen) == {"meta"}
