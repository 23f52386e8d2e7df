"""Greedy ``ssd`` equals the target's own ``generate`` for every architecture and fallback kind."""

import functools

import pytest
import torch

from tests.conftest import tiny_program
from tests.models import prompts, reference_greedy

# the arch-parametrized tests of test_greedy_exactness.py and test_ssd_greedy.py share tiny_pair's captures
# (about 3 s each): one pytest-xdist worker runs both files (make test: --dist loadgroup)
pytestmark = pytest.mark.xdist_group("tiny_pairs_every_arch")


@functools.cache
def ssd_program(arch: str, fallback: str):
    return tiny_program(arch, mode="ssd", fallback=fallback, fan_out="geometric", lane="thread")[2]


@pytest.mark.parametrize("fallback", ["neural", "fast", "auto"])
@pytest.mark.parametrize("batch, pad_rows", [(1, None), (3, {1: 4, 2: 1})])
def test_ssd_greedy_equals_target_generate(arch_pair, fallback, batch, pad_rows):
    target, _, _ = arch_pair
    arch = target.config.model_type
    program = ssd_program(arch, fallback)
    ids, mask = prompts(batch, 9, seed=batch, pad_rows=pad_rows)
    expected = reference_greedy(target, ids, mask, max_new_tokens=24)
    out = program.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=None)
    assert torch.equal(out.sequences, expected)
    stats = out.stats
    assert stats["mode"] == "ssd"
    # every lookup is a hit (counted by accepted length) or a miss (counted by the fallback that served
    # it); each round but the last looks up each active row once, and at least one row is active
    hits, misses = sum(stats["hits_by_position"].values()), sum(stats["fallbacks"].values())
    assert hits > 0, "the speculation cache never hit"
    assert stats["cache_hit_rate"] == pytest.approx(hits / (hits + misses))
    assert stats["rounds"] - 1 <= hits + misses <= batch * (stats["rounds"] - 1)
    if fallback != "auto":
        other = "fast" if fallback == "neural" else "neural"
        assert stats["fallbacks"][other] == 0


@pytest.mark.parametrize("fallback", ["neural", "fast"])
def test_ssd_eos_stops_one_sequence_early(arch_pair, fallback):
    target, _, _ = arch_pair
    program = ssd_program(target.config.model_type, fallback)
    ids, mask = prompts(3, 7, seed=11, pad_rows={2: 3})
    free_run = reference_greedy(target, ids, mask, max_new_tokens=16)
    eos = int(free_run[0, 7 + 3])
    expected = reference_greedy(target, ids, mask, max_new_tokens=16, eos_token_id=eos)
    out = program.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=eos)
    assert torch.equal(out.sequences, expected)


def test_ssd_misses_only_with_fan_out_zero():
    """Fan-out 0 builds no tree: every lookup misses and the fallback carries the whole generation."""
    target, _, program = tiny_program("llama", k=3, mode="ssd", fan_out=0, fallback="neural", lane="thread")
    ids, mask = prompts(2, 6, seed=4)
    out = program.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None)
    assert torch.equal(out.sequences, reference_greedy(target, ids, mask, 12))
    assert out.stats["cache_hit_rate"] == 0.0 and out.stats["fallbacks"]["neural"] > 0


@pytest.mark.heavy
def test_process_lane_is_exact_and_samples_like_the_thread_lane():
    """The draft side in another process: greedy equals generate; sampling equals the thread lane's.
    The tree is pinned (geometric fan-out): the planner's trees follow each lane's own measured costs."""
    target, _, program = tiny_program("qwen2", k=3, mode="ssd", lane="process", fan_out="geometric")
    try:
        ids, mask = prompts(3, 8, seed=9, pad_rows={0: 3})
        out = program.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=None)
        assert torch.equal(out.sequences, reference_greedy(target, ids, mask, 20))
        assert out.stats["lane"] == "process" and out.stats["cache_hit_rate"] > 0
        sampled = program.generate(
            ids, attention_mask=mask, max_new_tokens=12, temperature=1.0, seed=3, eos_token_id=None
        )
        threaded = program.reconfigure(lane="thread")
        same_seed = threaded.generate(
            ids, attention_mask=mask, max_new_tokens=12, temperature=1.0, seed=3, eos_token_id=None
        )
        threaded.close()
        assert torch.equal(sampled.sequences, same_seed.sequences)
    finally:
        program.close()


def test_planner_sampling_is_repeatable_for_a_seed():
    """With the planner (fan_out="auto"), sampled plans follow the warm-up's costs and the seed's outcomes
    only, so the same seed gives the same tokens, call after call."""
    _, _, program = tiny_program("llama", k=3, mode="ssd", lane="thread")
    try:
        ids, mask = prompts(2, 8, seed=4, pad_rows={1: 2})
        runs = [
            program.generate(
                ids, attention_mask=mask, max_new_tokens=16, temperature=1.0, seed=11, eos_token_id=None
            ).sequences
            for _ in range(3)
        ]
        assert torch.equal(runs[0], runs[1]) and torch.equal(runs[1], runs[2])
    finally:
        program.close()
