"""Geometric fan-out allocation and the online estimates of α and ρ."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from saguaro.runtime.draft.fan_out import OutcomeEstimator, geometric_fan_out, resolve_fan_out


@settings(max_examples=200, deadline=None)
@given(
    alpha=st.floats(0.05, 0.98),
    rho=st.floats(0.1, 5.0),
    k=st.integers(1, 16),
    extra=st.integers(0, 60),
    cap=st.integers(1, 40),
)
def test_allocation_sums_to_budget_capped_and_non_increasing(alpha, rho, k, extra, cap):
    budget = min(k + 1 + extra, (k + 1) * cap)
    fan = geometric_fan_out(alpha, rho, k, budget, cap)
    assert len(fan) == k + 1
    assert sum(fan) == budget
    assert all(1 <= f <= cap for f in fan)
    assert all(fan[j] >= fan[j + 1] for j in range(k - 1)), fan  # before the last position


def test_last_position_larger_when_alpha_high():
    fan = geometric_fan_out(0.9, 1.0, 5, 18)
    assert fan[5] > fan[4] and fan[5] == max(fan)
    low = geometric_fan_out(0.3, 1.0, 5, 18)
    assert low[5] < low[0]


def test_resolve_uniform_and_list():
    assert resolve_fan_out(3, 4, 15, None, cap=100) == [3] * 5
    assert resolve_fan_out([4, 3, 2, 1, 5], 4, 15, None, cap=3) == [3, 3, 2, 1, 3]


def test_alpha_estimate_converges_on_synthetic_outcomes():
    k, alpha = 5, 0.8
    gen = torch.Generator().manual_seed(0)
    accepts = torch.rand(20000, k, generator=gen) < alpha
    accepted = accepts.long().cumprod(1).sum(1)  # truncated geometric outcomes
    est = OutcomeEstimator(k)
    est.observe(accepted)
    assert est.alpha == pytest.approx(alpha, abs=0.01)


def test_rho_estimate_converges_on_synthetic_ranks():
    """Ranks drawn so that P(rank >= F) = F^-ρ (a discrete Pareto tail) recover ρ."""
    rho = 1.5
    gen = torch.Generator().manual_seed(1)
    u = torch.rand(50000, generator=gen)
    ranks = torch.floor(u ** (-1.0 / rho)).long() - 1  # P(rank >= F) = P(u^(-1/ρ) >= F+1) ~ (F+1)^-ρ
    est = OutcomeEstimator(5)
    est.observe(torch.zeros(0, dtype=torch.long), ranks)
    assert est.rho == pytest.approx(rho, rel=0.2)
    # and the allocation reacts: a steeper miss curve (higher ρ) flattens the fan-out less
    assert geometric_fan_out(0.8, est.rho, 5, 18) != geometric_fan_out(0.8, 0.2, 5, 18)


@pytest.mark.parametrize("fallback", ["fast", "neural"])
def test_alpha_counts_only_speculations_the_draft_made(monkeypatch, fallback):
    """α comes from hits and neural fallbacks, never from fast (n-gram) rounds, which accept less and would
    bias it down. Fan-out 0: every lookup misses; the first round's speculation is the draft's own (the
    neural ``start``), every later one the fallback's."""
    from tests.conftest import tiny_program
    from tests.models import prompts

    seen = []
    real = OutcomeEstimator.observe

    def recording(self, accepted, ranks=None):
        seen.append(list(accepted))
        return real(self, accepted, ranks)

    monkeypatch.setattr(OutcomeEstimator, "observe", recording)
    _, _, program = tiny_program("llama", k=3, mode="ssd", fan_out=0, fallback=fallback, lane="thread")
    ids, mask = prompts(1, 8, seed=6)
    out = program.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=None)
    rounds = out.stats["rounds"]
    assert out.stats["fallbacks"][fallback] == rounds - 1 and rounds > 2
    assert len(seen) == rounds - 1  # the outcome of every round but the last reaches the draft side
    observed = [a for round_seen in seen for a in round_seen]
    assert len(observed) == (1 if fallback == "fast" else rounds - 1)  # fast: the first round's outcome only
