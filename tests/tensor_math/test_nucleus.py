"""Step 6 of the sampling controls (``logits_processing.nucleus``): the tokens found among the most probable
candidates are exactly those of the full stable sort (ties by id), in rows where the nucleus ends among them and,
by the full sort, in rows where it does not."""

import torch

from saguaro.tensor_math import logits_processing as lp


def test_the_nucleus_equals_the_full_sort_with_ties_and_on_both_paths():
    generator = torch.Generator().manual_seed(0)
    fast_rows = fallback_rows = 0
    for trial in range(400):
        V = (16, 300, 4096)[trial % 3]
        logits = torch.randn(2, 4, V, generator=generator) * (0.3, 2.0, 8.0)[trial // 3 % 3]
        if trial % 5 == 0:
            logits = (logits * 2).round() / 2  # ties, at the boundary too
        probs = torch.softmax(logits, dim=-1)
        for top_p in (0.05, 0.5, 0.9, 0.999):
            want = lp.sorted_nucleus(probs.reshape(-1, V), top_p).reshape(probs.shape)
            assert torch.equal(lp.nucleus(probs, top_p), want), (trial, top_p)
            counts = want.reshape(-1, V).sum(-1)
            if V > lp.TOP_P_CANDIDATES:
                fast_rows += int((counts < lp.TOP_P_CANDIDATES).sum())
                fallback_rows += int((counts >= lp.TOP_P_CANDIDATES).sum())
    assert fast_rows > 100 and fallback_rows > 100  # both paths ran


def test_ties_at_the_boundary_keep_the_lowest_ids():
    probs = torch.tensor([[0.3, 0.2, 0.2, 0.2, 0.1] + [0.0] * 200])
    kept = lp.nucleus(probs, 0.6)  # 0.3 + 0.2 before the third: ids 0, 1, 2 kept, 3 (tied) not
    assert kept[0, :5].tolist() == [True, True, True, False, False] and not kept[0, 5:].any()
