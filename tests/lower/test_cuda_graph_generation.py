"""Whole generations through graphed stages, on CPU: every fixed-shape stage of an eager program runs
through a GraphedStage over a fake torch.cuda whose capture records the stage as one kernel and whose
replay reruns it (tests/lower/fake_cuda.py), with KV stores from a KVPool. Tokens stay exactly the
target's greedy ones (and the ungraphed program's sampled ones), later generations replay the graphs
of earlier ones because their stores sit at the same addresses."""

import functools

import pytest
import torch

import saguaro
from saguaro.core.stages import TARGET_VERIFY
from tests.lower.fake_cuda import FakeCuda, Kernelized
from tests.lower.graphed_program import counts, graphed
from tests.models import prompts, reference_greedy, tiny_target, truncated_draft

OPTIONS = dict(k=3, backend="eager", fan_out="geometric", fallback="neural", lane="thread")


@functools.lru_cache(maxsize=None)
def pair():
    target = tiny_target("llama", seed=5)
    return target, truncated_draft(target)


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_graphed_generations_equal_target_generate_and_replay_across_generations(monkeypatch, mode):
    cuda = FakeCuda().install(monkeypatch)
    target, draft = pair()
    program = saguaro.compile(target, draft, mode=mode, sd_when_faster=False, **OPTIONS)
    made = graphed(program, "cpu", lambda fn: Kernelized(fn, cuda))
    ids, mask = prompts(2, 7, seed=3, pad_rows={1: 2})
    expected = reference_greedy(target, ids, mask, max_new_tokens=14)
    after = []
    for _ in range(3):
        out = program.generate(ids, attention_mask=mask, max_new_tokens=14, eos_token_id=None)
        assert torch.equal(out.sequences, expected)
        assert out.stats["mode"] == mode
        after.append(counts(made))
    first, last = after[0], after[-1]
    assert first["captures"] > 0 and first["failed"] == 0 and first["passed"] == 0
    assert last["replays"] - first["replays"] > 2 * (last["captures"] - first["captures"]), after
    targets = [s for s in made["stores"] if s[0] == "target"]
    shape = targets[-1][1:3]
    addresses = {s[3] for s in targets if s[1:3] == shape}
    assert len(addresses) == 1, "every target store of one shape sits at the same address"
    verify = made["stages"][TARGET_VERIFY.greedy.qualified]
    assert verify.counts["captures"] == 1, "the later generations replay the first one's verify graph"


def test_graphed_sampling_equals_the_ungraphed_program(monkeypatch):
    target, draft = pair()
    plain = saguaro.compile(target, draft, mode="ssd", **OPTIONS)
    ids, mask = prompts(2, 6, seed=8)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, temperature=0.8, eos_token_id=None)
    want = [plain.generate(ids, seed=seed, **kwargs).sequences for seed in (0, 1)]
    cuda = FakeCuda().install(monkeypatch)
    program = saguaro.compile(target, draft, mode="ssd", **OPTIONS)
    made = graphed(program, "cpu", lambda fn: Kernelized(fn, cuda))
    for _ in range(2):
        got = [program.generate(ids, seed=seed, **kwargs).sequences for seed in (0, 1)]
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert counts(made)["replays"] > 0
