"""At temperature 1, SD and SSD preserve the distribution of a Gemma 2 target (mixed layer kinds, a
window shorter than the prompt, attention and final-logit softcapping): chi-square against the
exact joint of two generated tokens, which a target without final softcapping fails."""

import functools

import pytest
import torch

import saguaro
from tests.models import family_draft, tiny_family_target
from tests.stats_util import chi_square_pvalue

VOCAB = 16
SAMPLES = 6000
PROMPT = torch.tensor([[3, 7, 11, 4, 9, 13]])  # longer than the window


@functools.cache
def models():
    target = tiny_family_target("gemma2", vocab_size=VOCAB, logit_scale=12.0, seed=5)
    return target, family_draft(target)


def exact_joint(target, prefix: int = 0) -> torch.Tensor:
    """``P(t_{prefix+1}, t_{prefix+2})`` at temperature 1, summing over the first ``prefix`` tokens: ``[V, V]``."""
    V, T = VOCAB, PROMPT.shape[1]
    grid = torch.cartesian_prod(*[torch.arange(V)] * (prefix + 1)).reshape(-1, prefix + 1)  # [V^(p+1), p+1]
    seqs = torch.cat([PROMPT.expand(grid.shape[0], T), grid], dim=1)
    with torch.no_grad():
        logp = torch.log_softmax(target(seqs).logits.float(), dim=-1)  # [N, T+p+1, V]
    log_joint = logp[:, T + prefix]  # [N, V]: the last token's distribution
    for i in range(prefix + 1):
        log_joint = log_joint + logp[:, T - 1 + i].gather(1, grid[:, i : i + 1])
    joint = torch.exp(log_joint).reshape(-1, V, V)  # [V^prefix, V, V]
    return joint.sum(0)  # [V, V]


def sampled_joint(program, first: int) -> tuple[torch.Tensor, dict]:
    out = program.generate(
        PROMPT.expand(SAMPLES, -1), max_new_tokens=first + 2, temperature=1.0, seed=0, eos_token_id=None
    )
    a, b = out.sequences[:, -2], out.sequences[:, -1]
    return torch.bincount(a * VOCAB + b, minlength=VOCAB * VOCAB).reshape(VOCAB, VOCAB), out.stats


def test_sd_sampling_matches_the_gemma2_joint_and_final_softcap_matters():
    target, draft = models()
    counts, stats = sampled_joint(
        saguaro.compile(target, draft, k=2, mode="sd", backend="eager", sd_when_faster=False), first=0
    )
    assert 1.0 < stats["mean_accepted_len"]
    assert chi_square_pvalue(counts, exact_joint(target)) > 1e-3
    uncapped = tiny_family_target(
        "gemma2", vocab_size=VOCAB, logit_scale=12.0, seed=5, final_logit_softcapping=None
    )
    assert chi_square_pvalue(counts, exact_joint(uncapped)) < 1e-6, "the test cannot see final softcapping"
    # the prompt is longer than the window, and the window changes the joint: a target attending to the
    # whole prompt is rejected too
    unwindowed = tiny_family_target(
        "gemma2", vocab_size=VOCAB, logit_scale=12.0, seed=5, layer_types=["full_attention"] * 2
    )
    assert chi_square_pvalue(counts, exact_joint(unwindowed)) < 1e-6, "the test cannot see the sliding window"


@pytest.mark.heavy
def test_ssd_cache_hits_sample_the_gemma2_joint():
    """``k = 1`` and every outcome cached: tokens 3 and 4 come from rounds served by cache hits."""
    target, draft = models()
    program = saguaro.compile(
        target,
        draft,
        k=1,
        mode="ssd",
        lane="thread",
        fan_out=[VOCAB - 1, VOCAB],
        fallback="neural",
        backend="eager",
        sd_when_faster=False,
    )
    try:
        counts, stats = sampled_joint(program, first=2)
    finally:
        program.close()
    assert stats["cache_hit_rate"] > 0.99
    assert chi_square_pvalue(counts, exact_joint(target, prefix=2)) > 1e-3
