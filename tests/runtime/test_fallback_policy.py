"""The ``fallback="auto"`` policy keeps exploring: one unlucky round never locks a kind out, its means
cover a window of recent rounds, a sampled generation's choices depend on its outcomes only, and the
stats count fallbacks by kind."""

import pytest
import torch

from saguaro.runtime.draft.fallback import EXPLORE_EVERY, WINDOW, FallbackPolicy
from tests.conftest import tiny_program
from tests.models import prompts, reference_greedy

VERIFY_S, NEURAL_S = 10e-3, 4e-3


def fallback_round(policy: FallbackPolicy, kind: str, decided: int, neural_s: float = NEURAL_S) -> None:
    """One fallback round of one row as the server reports it: the kind taken, its cost (neural), then
    the verify's outcome of the speculation it made (``decided`` = a + 1 tokens)."""
    policy.took(kind)
    if kind == "neural":
        policy.neural_s.append(neural_s)
    policy.observe_round([kind], [decided - 1], VERIFY_S)


def drive(policy: FallbackPolicy, rounds: int, decided: dict) -> list[str]:
    """``rounds`` misses, each taking the kind the policy chooses and deciding ``decided[kind]`` tokens."""
    taken = []
    for _ in range(rounds):
        kind = policy.choose()
        taken.append(kind)
        fallback_round(policy, kind, decided[kind])
    return taken


def test_one_unlucky_neural_round_does_not_lock_neural_out():
    policy = FallbackPolicy("auto", batch=1)
    fallback_round(policy, "neural", 1)  # unlucky: nothing accepted
    fallback_round(policy, "fast", 2)
    # neural 1 token / 14 ms against fast 2 / 10 ms: fast, on what was measured so far
    assert policy.choose() == "fast"
    # from now on the neural fallback is good (5 tokens in 14 ms), the fast one as before
    taken = drive(policy, 60, {"neural": 5, "fast": 2})
    back = taken.index("neural")
    assert back < EXPLORE_EVERY  # tried again within EXPLORE_EVERY rounds of fast in a row ...
    assert taken[back - 1] == "fast" and all(k == "fast" for k in taken[:back])
    # ... and once its mean shows it pays, it is the one taken: every fast round after that is a single
    # exploration round after EXPLORE_EVERY neural ones
    after = taken[back:]
    assert after.count("neural") >= len(after) * EXPLORE_EVERY // (EXPLORE_EVERY + 1)
    for i, kind in enumerate(after):
        if kind == "fast":
            assert after[i - EXPLORE_EVERY : i] == ["neural"] * EXPLORE_EVERY and after[i + 1 : i + 2] in (
                [],
                ["neural"],
            )


def test_the_means_cover_a_window_of_recent_rounds():
    policy = FallbackPolicy("auto", batch=1)
    for _ in range(3 * WINDOW):
        fallback_round(policy, "neural", 1)
    fallback_round(policy, "fast", 2)
    assert policy.choose() == "fast"
    for _ in range(WINDOW):  # the neural fallback got better: only the latest WINDOW rounds count
        fallback_round(policy, "neural", 5)
    assert policy.mean_accepted("neural") == 5.0 and len(policy.neural_s) == WINDOW
    fallback_round(policy, "fast", 2)  # (the exploration round after the neural streak)
    assert policy.mean_accepted("fast") == 2.0
    assert policy.choose() == "neural"  # 5 tokens in 14 ms against 2 in 10


def test_rows_of_a_round_count_by_the_kind_their_speculation_came_from():
    policy = FallbackPolicy("auto", batch=3)
    policy.observe_round(["hit", "neural", "fast"], [3, 1, None], VERIFY_S)  # the third row had finished
    assert list(policy.accepted["neural"]) == [2] and list(policy.accepted["fast"]) == []
    assert list(policy.verify_s) == [VERIFY_S]
    assert policy.mean_accepted("fast") is None and policy.mean_accepted("fast", 1.0) == 1.0


@pytest.mark.parametrize("batch, first", [(1, "neural"), (16, "fast")])
def test_without_timing_or_fixed_costs_the_batch_size_decides(batch, first):
    policy = FallbackPolicy("auto", batch=batch, timed=False)
    assert drive(policy, 20, {"neural": 1, "fast": 3}) == [first] * 20


def test_with_fixed_costs_the_choices_depend_on_the_outcomes_only():
    """Sampled generations: the same outcomes give the same choices whatever the measured times, and the
    exploration still happens (it counts rounds, not seconds)."""
    runs = []
    for neural_s in (1e-3, 50e-3):
        policy = FallbackPolicy("auto", batch=1, fixed_costs=(VERIFY_S, NEURAL_S), timed=False)
        taken = []
        for i in range(40):
            kind = policy.choose()
            taken.append(kind)
            fallback_round(
                policy,
                kind,
                1 if (kind == "neural" and i == 0) else (5 if kind == "neural" else 2),
                neural_s=neural_s,
            )
        runs.append(taken)
    assert runs[0] == runs[1]
    assert "fast" in runs[0] and runs[0][-EXPLORE_EVERY:].count("neural") >= EXPLORE_EVERY - 1


def test_a_fixed_kind_is_always_taken():
    for kind in ("neural", "fast"):
        policy = FallbackPolicy(kind, batch=1)
        assert drive(policy, 12, {"neural": 1, "fast": 5}) == [kind] * 12


def test_auto_fallbacks_are_counted_by_kind_and_output_stays_exact():
    """Fan-out 0: every lookup misses, so the policy serves every round after the first; over enough
    rounds both kinds are taken (it explores), and the stats count each kind's misses."""
    target, _, program = tiny_program("llama", k=3, mode="ssd", fan_out=0, fallback="auto", lane="thread")
    ids, mask = prompts(1, 8, seed=4)
    out = program.generate(ids, attention_mask=mask, max_new_tokens=48, eos_token_id=None)
    assert torch.equal(out.sequences, reference_greedy(target, ids, mask, 48))
    stats = out.stats
    assert stats["cache_hit_rate"] == 0.0
    fallbacks = stats["fallbacks"]
    assert sum(fallbacks.values()) == stats["rounds"] - 1  # one row, one miss a round but the last
    assert stats["rounds"] - 1 >= EXPLORE_EVERY + 1 and fallbacks["neural"] > 0 and fallbacks["fast"] > 0
