"""Unit tests of the verification math (the plain tensor functions the passes will splice)."""

import torch

from saguaro.tensor_math.verification import one_hot_proposal, verify_speculation
from tests.stats_util import chi_square_pvalue


def test_greedy_accepts_longest_matching_prefix():
    V = 6
    # target argmax per row: 1, 2, 3, 4
    logits = torch.full((2, 4, V), -5.0)
    for i, tok in enumerate([1, 2, 3, 4]):
        logits[:, i, tok] = 5.0
    draft = torch.tensor([[1, 2, 0], [1, 2, 3]])
    accepted, nxt = verify_speculation(logits, draft, None, 0.0)
    assert accepted.tolist() == [2, 3]
    assert nxt.tolist() == [3, 4]  # recovery for row 0, bonus for row 1


def test_greedy_rejects_first_token():
    logits = torch.zeros(1, 3, 4)
    logits[0, :, 2] = 1.0
    accepted, nxt = verify_speculation(logits, torch.tensor([[1, 2]]), None, 0.0)
    assert accepted.tolist() == [0] and nxt.tolist() == [2]


def _outcome_distribution(p, q, samples, one_hot_token=None):
    """Empirical distribution of the first output token of a k=1 round, drawn with proposals from q."""
    V = p.shape[-1]
    gen = torch.Generator().manual_seed(0)
    logits = torch.log(p)[None, None, :].expand(samples, 2, V).clone()  # temperature 1: softmax(log p) = p
    if one_hot_token is None:
        draft = torch.multinomial(q.expand(samples, V), 1, replacement=True, generator=gen)  # [N, 1]
        probs = q[None, None, :].expand(samples, 1, V)
    else:
        draft = torch.full((samples, 1), one_hot_token)
        probs = one_hot_proposal(draft, V)
    accepted, nxt = verify_speculation(logits, draft, probs, 1.0, gen)
    first = torch.where(accepted > 0, draft[:, 0], nxt)
    return torch.bincount(first, minlength=V)


def test_sampled_verification_preserves_target_distribution():
    p = torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1])
    q = torch.tensor([0.3, 0.1, 0.1, 0.2, 0.3])
    counts = _outcome_distribution(p, q, 20000)
    assert chi_square_pvalue(counts, p) > 1e-3


def test_one_hot_proposal_is_exact():
    """A deterministic (fast-fallback) proposal verified as δ_x keeps the target's distribution."""
    p = torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1])
    counts = _outcome_distribution(p, None, 20000, one_hot_token=2)
    assert chi_square_pvalue(counts, p) > 1e-3


def test_chi_square_detects_a_wrong_distribution():
    """The statistic used throughout can fail: counts drawn from q do not pass as p."""
    p = torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1])
    q = torch.tensor([0.3, 0.1, 0.1, 0.2, 0.3])
    counts = torch.bincount(
        torch.multinomial(q, 20000, replacement=True, generator=torch.Generator().manual_seed(1)), minlength=5
    )
    assert chi_square_pvalue(counts, p) < 1e-6
