"""At temperature 1, SSD preserves the target's distribution on every path, each forced by config.

The tested tokens are the 3rd and 4th generated ones: with ``k = 1`` they come from rounds whose
speculation was served by the cache or a fallback (the first round's comes from the draft alone).
"""

import functools

import pytest
import torch

import saguaro
from saguaro.tensor_math import verification
from tests.models import tiny_target, truncated_draft
from tests.runtime.test_sampling_exactness import greedy_comparison_verifier
from tests.stats_util import chi_square_pvalue

VOCAB = 16
SAMPLES = 6000
PROMPT = torch.tensor([[3, 7, 11, 4]])


@functools.cache
def models():
    target = tiny_target("llama", vocab_size=VOCAB, logit_scale=12.0, seed=5)
    return target, truncated_draft(target, noise=0.8)


@functools.cache
def exact_late_joint() -> torch.Tensor:
    """``P(t3, t4)`` at temperature 1, summing over ``t1, t2``: ``[V, V]``."""
    target, _ = models()
    V, T = VOCAB, PROMPT.shape[1]
    grid = torch.cartesian_prod(torch.arange(V), torch.arange(V), torch.arange(V))  # [V^3, 3]
    seqs = torch.cat([PROMPT.expand(V**3, T), grid], dim=1)  # [V^3, T+3]
    with torch.no_grad():
        logp = torch.log_softmax(target(seqs).logits.float(), dim=-1)  # [V^3, T+3, V]
    log_t1 = logp[:, T - 1].gather(1, grid[:, :1])  # p(t1)
    log_t2 = logp[:, T].gather(1, grid[:, 1:2])  # p(t2 | t1)
    log_t3 = logp[:, T + 1].gather(1, grid[:, 2:3])  # p(t3 | t1 t2)
    joint = torch.exp(log_t1 + log_t2 + log_t3 + logp[:, T + 2])  # [V^3, V]: p(t1 t2 t3 t4)
    return joint.reshape(V, V, V, V).sum(dim=(0, 1))  # [V(t3), V(t4)]


def compiled_program():
    target, draft = models()
    return saguaro.compile(
        target, draft, k=1, mode="ssd", lane="thread", backend="eager", sd_when_faster=False
    )


captured_program = functools.lru_cache(maxsize=None)(compiled_program)  # one capture for every path


def sampled_late_joint(fresh: bool = False, **config):
    """Each path's options are runtime ones (``Program.reconfigure``). ``fresh``: a program of its own,
    so a patched verifier is spliced when its stages are built."""
    program = (compiled_program() if fresh else captured_program()).reconfigure(**config)
    out = program.generate(
        PROMPT.expand(SAMPLES, -1), max_new_tokens=4, temperature=1.0, seed=0, eos_token_id=None
    )
    t3, t4 = out.sequences[:, -2], out.sequences[:, -1]
    counts = torch.bincount(t3 * VOCAB + t4, minlength=VOCAB * VOCAB).reshape(VOCAB, VOCAB)
    return counts, out.stats


PATHS = {
    # every possible outcome is cached: row 0 holds all V-1 non-rejected tokens, row k all V
    "hits_only": dict(fan_out=[VOCAB - 1, VOCAB], fallback="neural"),
    "neural_misses": dict(fan_out=0, fallback="neural"),
    "fast_misses": dict(fan_out=0, fallback="fast"),
    "saguaro_c": dict(fan_out=[2, 2], fallback="neural", saguaro_c=0.5),
}


@pytest.mark.heavy
@pytest.mark.parametrize("path", sorted(PATHS))
def test_ssd_sampling_matches_target_distribution(path):
    counts, stats = sampled_late_joint(**PATHS[path])
    if path == "hits_only":
        assert stats["cache_hit_rate"] == 1.0 and stats["fallbacks"] == {"neural": 0, "fast": 0}
    elif path == "neural_misses":
        assert stats["cache_hit_rate"] == 0.0 and stats["fallbacks"]["neural"] > 0
    elif path == "fast_misses":
        assert stats["cache_hit_rate"] == 0.0 and stats["fallbacks"]["fast"] > 0
    else:
        assert 0.0 < stats["cache_hit_rate"] < 1.0
    assert chi_square_pvalue(counts, exact_late_joint()) > 1e-3


def test_biased_fast_fallback_verification_is_caught(monkeypatch):
    """Accepting fast-fallback tokens by greedy comparison (the reference implementation) is biased."""
    monkeypatch.setattr(verification, "verify_sampled", greedy_comparison_verifier)
    counts, _ = sampled_late_joint(fresh=True, **PATHS["fast_misses"])
    assert chi_square_pvalue(counts, exact_late_joint()) < 1e-6
