"""At temperature 1, SD preserves the target's distribution; a biased verifier is caught."""

import pytest
import torch

import saguaro
from saguaro.tensor_math import verification
from tests.models import SHARP_VOCAB, sharp_sd_pair
from tests.stats_util import chi_square_pvalue

VOCAB = SHARP_VOCAB
SAMPLES = 6000
PROMPT = torch.tensor([[3, 7, 11, 4]])


def sampling_setup():
    return sharp_sd_pair(k=2)


def exact_joint(target) -> torch.Tensor:
    """``P(t1, t2)`` of the first two generated tokens at temperature 1, ``[V, V]``."""
    with torch.no_grad():
        p1 = torch.softmax(target(PROMPT).logits[0, -1].float(), -1)  # [V]
        follow = torch.cat([PROMPT.expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], dim=1)  # [V, T+1]
        p2 = torch.softmax(target(follow).logits[:, -1].float(), -1)  # [V, V]
    return p1[:, None] * p2


def sampled_joint(program, seed=0) -> torch.Tensor:
    out = program.generate(
        PROMPT.expand(SAMPLES, -1), max_new_tokens=2, temperature=1.0, seed=seed, eos_token_id=None
    )
    t1, t2 = out.sequences[:, -2], out.sequences[:, -1]
    return torch.bincount(t1 * VOCAB + t2, minlength=VOCAB * VOCAB).reshape(VOCAB, VOCAB)


def test_sd_sampling_matches_target_joint_distribution():
    target, draft, program = sampling_setup()
    counts = sampled_joint(program)
    assert chi_square_pvalue(counts, exact_joint(target)) > 1e-3


def test_sd_sampling_uses_the_draft():
    """The test above exercises verification: the draft's tokens are accepted in some rounds."""
    _, _, program = sampling_setup()
    out = program.generate(
        PROMPT.expand(512, -1), max_new_tokens=3, temperature=1.0, seed=1, eos_token_id=None
    )
    assert 1.0 < out.stats["mean_accepted_len"] < 3.0


def greedy_comparison_verifier(
    target_logits, draft_tokens, draft_probs, inv_temperature, accept_u, resample_u
):
    """The biased rule: accept a draft token iff it is the target's argmax, resample from p otherwise."""
    K = draft_tokens.shape[1]
    choice = target_logits.argmax(-1)  # [B, K+1]
    accepted = (choice[:, :K] == draft_tokens).long().cumprod(1).sum(1)
    p = torch.softmax(target_logits.float() * inv_temperature, dim=-1)
    row = p.gather(1, accepted[:, None, None].expand(-1, 1, p.shape[-1])).squeeze(1)
    return accepted, verification.sample_inverse_cdf(row, resample_u)


def test_chi_square_rejects_a_biased_verifier(monkeypatch):
    target, draft, _ = sampling_setup()
    # the splice_epilogue pass splices whatever verify_sampled is when the stage is built
    monkeypatch.setattr(verification, "verify_sampled", greedy_comparison_verifier)
    program = saguaro.compile(target, draft, k=2, mode="sd", backend="eager", sd_when_faster=False)
    counts = sampled_joint(program)
    assert chi_square_pvalue(counts, exact_joint(target)) < 1e-6


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_same_seed_same_samples(mode):
    _, _, program = sampling_setup()
    a = program.generate(PROMPT, max_new_tokens=8, temperature=0.7, seed=42, mode=mode, eos_token_id=None)
    b = program.generate(PROMPT, max_new_tokens=8, temperature=0.7, seed=42, mode=mode, eos_token_id=None)
    assert torch.equal(a.sequences, b.sequences)
