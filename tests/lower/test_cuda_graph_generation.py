"""Whole generations through graphed stages, on CPU: every fixed-shape stage of an eager program runs
through a GraphedStage over a fake torch.cuda whose capture records the stage as one kernel and whose
replay reruns it (tests/lower/fake_cuda.py), with KV stores from a KVPool and sequence buffers from a
SequencePool. Tokens stay exactly the target's greedy ones (and the ungraphed program's sampled ones),
later generations replay the graphs of earlier ones because their stores and buffers sit at the same
addresses; a stage whose first replay differs runs ungraphed, and the stats say so."""

import functools

import pytest
import torch

import saguaro
from saguaro.core.stages import TARGET_ROUND, TARGET_VERIFY
from saguaro.runtime.decode.sd_graph import ROUND_NAME
from tests.lower.fake_cuda import FakeCuda, Kernelized
from tests.lower.graphed_program import counts, graphed
from tests.models import prompts, reference_greedy, tiny_target, truncated_draft

OPTIONS = dict(k=3, backend="eager", fan_out="geometric", fallback="neural", lane="thread")


@functools.cache
def pair():
    target = tiny_target("llama", seed=5)
    return target, truncated_draft(target)


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_graphed_generations_equal_target_generate_and_replay_across_generations(monkeypatch, mode):
    cuda = FakeCuda().install(monkeypatch)
    target, draft = pair()
    program = saguaro.compile(target, draft, mode=mode, sd_when_faster=False, **OPTIONS)
    made = graphed(program, "cpu", lambda fn, stage: Kernelized(fn, cuda))
    ids, mask = prompts(2, 7, seed=3, pad_rows={1: 2})
    expected = reference_greedy(target, ids, mask, max_new_tokens=14)
    after = []
    for _ in range(3):
        out = program.generate(ids, attention_mask=mask, max_new_tokens=14, eos_token_id=None)
        assert torch.equal(out.sequences, expected)
        assert out.stats["mode"] == mode
        after.append(counts(made) | {"rounds": out.stats["rounds"] + (after[-1]["rounds"] if after else 0)})
    first, last = after[0], after[-1]
    assert first["captures"] > 0 and first["failed"] == 0 and first["passed"] == 0
    assert last["replays"] - first["replays"] > 2 * (last["captures"] - first["captures"]), after
    targets = [s for s in made["stores"] if s[0] == "target"]
    shape = targets[-1][1:3]
    addresses = {s[3] for s in targets if s[1:3] == shape}
    assert len(addresses) == 1, "every target store of one shape sits at the same address"
    verify = made["stages"][TARGET_VERIFY.greedy.qualified]
    if mode == "ssd":
        assert verify.counts["captures"] == 1, "the later generations replay the first one's verify graph"
        return
    # SD: the k draft steps and the verify are one graph, captured once; its stages run inside it
    rounds = made["stages"][f"{ROUND_NAME} k=3"]
    assert (
        rounds.counts["captures"] == 1 and rounds.counts["checks"] == 1 and rounds.counts["mismatches"] == 0
    )
    assert rounds.counts["replays"] == last["rounds"] - 1, (
        "every SD round but the first (its warm-up) replays"
    )
    assert verify.counts["captures"] == 0 and verify.counts["enclosed"] == last["rounds"] + 2


def test_graphed_sampling_equals_the_ungraphed_program(monkeypatch):
    target, draft = pair()
    plain = saguaro.compile(target, draft, mode="ssd", **OPTIONS)
    ids, mask = prompts(2, 6, seed=8)
    kwargs = dict(attention_mask=mask, max_new_tokens=12, temperature=0.8, eos_token_id=None)
    want = [plain.generate(ids, seed=seed, **kwargs).sequences for seed in (0, 1)]
    cuda = FakeCuda().install(monkeypatch)
    program = saguaro.compile(target, draft, mode="ssd", **OPTIONS)
    made = graphed(program, "cpu", lambda fn, stage: Kernelized(fn, cuda))
    for _ in range(2):
        got = [program.generate(ids, seed=seed, **kwargs).sequences for seed in (0, 1)]
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert counts(made)["replays"] > 0


def test_graphed_ar_rounds_equal_the_ungraphed_program_and_replay_in_later_generations(monkeypatch):
    target, _ = pair()
    ids, mask = prompts(2, 7, seed=4, pad_rows={0: 3})
    kwargs = dict(attention_mask=mask, max_new_tokens=12, eos_token_id=None)
    plain = saguaro.compile(target, None, mode="ar", backend="eager").generate(ids, **kwargs)
    assert torch.equal(plain.sequences, reference_greedy(target, ids, mask, max_new_tokens=12))
    cuda = FakeCuda().install(monkeypatch)
    program = saguaro.compile(target, None, mode="ar", backend="eager")
    made = graphed(program, "cpu", lambda fn, stage: Kernelized(fn, cuda))
    for _ in range(3):
        out = program.generate(ids, **kwargs)
        assert torch.equal(out.sequences, plain.sequences)  # token for token
        assert out.stats["graphs_off"] == {} and out.stats["plan"] == "mode ar asked"
    rounds = made["stages"][TARGET_ROUND.qualified]
    assert rounds.counts["captures"] == 1 and len(rounds._entries) == 1, "one graph for every generation"
    assert (
        rounds.counts["replays"] == 3 * 11 - 1 and rounds.counts["checks"] == 1
    )  # all rounds but the warm-up
    assert program.target.seq_pool.reused == 2, "the later generations took the first one's buffers"
    (pooled,) = program.target.seq_pool._free.values()  # the buffers, back in the pool
    (signature,) = rounds._entries
    assert pooled.tokens.data_ptr() in {part[0] for part in signature[-1] if len(part) == 4}, (
        "the token buffer the round writes in place is part of its graph's signature, at its fixed address"
    )


def _wrong_first_output(outputs):
    outputs[0].add_(1)  # a graph that replays wrong


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_a_stage_whose_replay_differs_runs_ungraphed_and_the_stats_say_so(monkeypatch, caplog, mode):
    """SD: its round (the draft steps and the verify in one graph) replays wrong; SSD: the verify does."""
    target, draft = pair()
    cuda = FakeCuda().install(monkeypatch)
    program = saguaro.compile(target, draft, mode=mode, sd_when_faster=False, **OPTIONS)
    wrong = f"{ROUND_NAME} k=3" if mode == "sd" else TARGET_VERIFY.greedy.qualified
    made = graphed(
        program,
        "cpu",
        lambda fn, stage: Kernelized(
            fn,
            cuda,
            _wrong_first_output
            if (stage.qualified if stage is not None else f"{ROUND_NAME} k=3") == wrong
            else None,
        ),
    )
    ids, mask = prompts(2, 7, seed=3)
    expected = reference_greedy(target, ids, mask, max_new_tokens=14)
    with caplog.at_level("WARNING", logger="saguaro.lower.cuda_graphs"):
        outs = [
            program.generate(ids, attention_mask=mask, max_new_tokens=14, eos_token_id=None) for _ in range(2)
        ]
    assert all(torch.equal(out.sequences, expected) for out in outs), (
        "the check's call returns the right outputs"
    )
    why = "the first replay of its CUDA graph differs from the stage run without it: output 0"
    asked = "mode sd asked" if mode == "sd" else "SSD on the thread lane"
    for out in outs:
        assert list(out.stats["graphs_off"]) == [wrong] and out.stats["graphs_off"][wrong].startswith(why)
        assert out.stats["plan"].startswith(f"{asked}; {wrong} runs without CUDA graphs ({why}"), out.stats[
            "plan"
        ]
    stages = made["stages"]
    assert stages[wrong].counts["mismatches"] == 1 and stages[wrong].counts["passed"] > 0
    others = [s for name, s in stages.items() if name != wrong and s.counts["captures"]]
    assert others and all(
        s.counts["mismatches"] == 0 and s.counts["replays"] > s.counts["checks"] for s in others
    )
    assert caplog.text.count(f"stage {wrong}: {why}") == 1


def test_the_sd_round_runs_stage_by_stage_when_sampled_traced_or_across_devices():
    from types import SimpleNamespace

    from saguaro.runtime.decode.sd_graph import graphed_sd_round

    target = SimpleNamespace(
        spec=SimpleNamespace(device=torch.device("cpu")),
        graphed=lambda *args: pytest.fail("no graph is asked for"),
    )
    for temperature, recorder, device in ((0.8, None, "cpu"), (0.0, object(), "cpu"), (0.0, None, "meta")):
        draft = SimpleNamespace(spec=SimpleNamespace(device=torch.device(device)))
        state = SimpleNamespace(temperature=temperature, recorder=recorder)
        assert graphed_sd_round(target, draft, state, None, None) is None
