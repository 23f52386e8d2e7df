"""Greedy ``ar`` and ``sd`` outputs equal the target's own ``generate`` token for token."""

import pytest
import torch

from tests.models import prompts, reference_greedy

# the arch-parametrized tests of test_greedy_exactness.py and test_ssd_greedy.py share tiny_pair's captures
# (about 3 s each): one pytest-xdist worker runs both files (make test: --dist loadgroup)
pytestmark = pytest.mark.xdist_group("tiny_pairs_every_arch")

BATCHES = {
    1: [dict(batch=1, length=5, pad_rows=None), dict(batch=1, length=13, pad_rows=None)],
    3: [dict(batch=3, length=9, pad_rows={1: 4, 2: 1}), dict(batch=3, length=4, pad_rows={0: 2})],
}


@pytest.mark.parametrize("mode", ["ar", "sd"])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_equals_target_generate(arch_pair, mode, batch):
    target, _, program = arch_pair
    for seed, shape in enumerate(BATCHES[batch]):
        ids, mask = prompts(shape["batch"], shape["length"], seed=seed, pad_rows=shape["pad_rows"])
        expected = reference_greedy(target, ids, mask, max_new_tokens=20)
        out = program.generate(ids, attention_mask=mask, max_new_tokens=20, mode=mode, eos_token_id=None)
        assert out.sequences.shape == expected.shape
        assert torch.equal(out.sequences, expected), f"{mode} diverged from target.generate"
        assert out.stats["new_tokens"] == 20 * shape["batch"]


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_eos_stops_one_sequence_early(arch_pair, mode):
    target, _, program = arch_pair
    ids, mask = prompts(3, 7, seed=11, pad_rows={2: 3})
    free_run = reference_greedy(target, ids, mask, max_new_tokens=16)
    # an EOS that row 0 emits at its 4th new token and that other rows emit later or never
    eos = int(free_run[0, 7 + 3])
    expected = reference_greedy(target, ids, mask, max_new_tokens=16, eos_token_id=eos)
    out = program.generate(ids, attention_mask=mask, max_new_tokens=16, mode=mode, eos_token_id=eos)
    assert torch.equal(out.sequences, expected)
    generated = out.sequences[0, 7:]
    first = int((generated == eos).nonzero()[0])
    assert first <= 3 and bool((generated[first + 1 :] == 0).all()), (
        "a finished row must be padded, never extended"
    )


def test_sd_accepts_draft_tokens(arch_pair):
    """The truncated draft agrees with the target often: SD must accept more than one token per call."""
    _, _, program = arch_pair
    ids, mask = prompts(1, 6, seed=3)
    out = program.generate(ids, attention_mask=mask, max_new_tokens=24, mode="sd", eos_token_id=None)
    assert out.stats["mean_accepted_len"] > 1.0
    assert out.stats["rounds"] < 24
    # the rate after the prefill: the 23 tokens its rounds decided over the seconds after it
    stats = out.stats
    assert stats["decode_tokens_per_s"] == pytest.approx(23 / (stats["wall_s"] - stats["prefill_s"]))
