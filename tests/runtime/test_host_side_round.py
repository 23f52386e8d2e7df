"""The parts of a round that moved off the device→host path agree with what they replaced: the fast
fallback's n-gram proposal (now all rows at once on the device), the speculation cache's match (now
on the host, from the table the build read), and the host view of the sequences."""

import pytest
import torch

from saguaro.runtime.base.sequences import SequenceBatch
from saguaro.runtime.draft.fallback import fast_fallback
from saguaro.runtime.draft.speculation_cache import SpeculationCache


def loop_fast_fallback(seqs: SequenceBatch, rows: list, k: int) -> torch.Tensor:
    """The fast fallback as it was, one row at a time on the host: the oracle."""
    proposals = []
    for row in rows:
        context = seqs.tokens[row, : int(seqs.lengths[row])]
        last = context[-1]
        earlier = (context[:-1] == last).nonzero().flatten()
        follow = context[int(earlier[-1]) + 1 : int(earlier[-1]) + 1 + k] if earlier.numel() else context[:0]
        proposals.append(torch.cat([follow, last.expand(k - follow.numel())]))
    return torch.stack(proposals) if proposals else torch.zeros(0, k, dtype=torch.long)


def random_batch(seed: int, batch: int = 6, prompt: int = 7, vocab: int = 5) -> SequenceBatch:
    """Rows of a small vocabulary (so tokens repeat), left-padded, then grown by different amounts."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, prompt), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    seqs = SequenceBatch(ids, mask, max_new_tokens=12, capacity=prompt + 16, eos_token_ids=[], pad_token_id=0)
    for _ in range(3):
        candidates = torch.randint(0, vocab, (batch, 4), generator=gen)
        seqs.append(candidates, torch.randint(1, 5, (batch,), generator=gen))
    return seqs


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("k", [1, 3, 6])
def test_fast_fallback_equals_the_row_by_row_proposal(seed, k):
    seqs = random_batch(seed)
    for rows in ([0, 1, 2, 3, 4, 5], [1, 4], [3], []):
        tokens, probs = fast_fallback(seqs, torch.tensor(rows, dtype=torch.long), k, 5, temperature=0.0)
        assert torch.equal(tokens, loop_fast_fallback(seqs, rows, k)), (seed, k, rows)
        assert probs is None
    tokens, probs = fast_fallback(seqs, torch.tensor([2, 0]), k, 5, temperature=1.0)
    assert torch.equal(probs, torch.nn.functional.one_hot(tokens, 5).float())


@pytest.mark.parametrize("seed", range(6))
def test_host_match_equals_the_device_match(seed):
    gen = torch.Generator().manual_seed(seed)
    B, K, V = 5, 3, 6
    fan_out = [2, 1, 0, 3]
    rows = [j for j, f in enumerate(fan_out) for _ in range(f)]
    MQ = len(rows)
    candidates = torch.randint(0, V, (B, MQ), generator=gen)  # duplicates too: the first branch wins
    cache = SpeculationCache(
        branch_rows=torch.tensor(rows),
        candidates=candidates,
        tokens=torch.zeros(B, MQ, K, dtype=torch.long),
        probs=None,
        ranked=torch.zeros(B, K + 1, 4, dtype=torch.long),
    )
    cache.index_on_host(rows, candidates.tolist())
    for _ in range(20):
        accepted = torch.randint(0, K + 1, (B,), generator=gen)
        outcome = torch.randint(0, V, (B,), generator=gen)
        hit, branch = cache.match(accepted, outcome)
        host_hit, host_branch = cache.match_host(accepted.tolist(), outcome.tolist())
        assert host_hit == hit.tolist()
        assert [b for b, h in zip(host_branch, host_hit) if h] == branch[hit].tolist()
    # a row that is not looked up (None: it had finished) misses
    assert cache.match_host([None] * B, [0] * B) == ([False] * B, [0] * B)


def test_the_host_view_follows_appends_with_one_read():
    ids = torch.tensor([[3, 4, 5], [6, 7, 8]])
    seqs = SequenceBatch(
        ids, torch.ones_like(ids), max_new_tokens=2, capacity=8, eos_token_ids=[9], pad_token_id=0
    )
    assert seqs.host_active == [True, True] and seqs.host_lengths == [3, 3]  # no read: known at construction
    seqs.append(torch.tensor([[9, 1], [1, 2]]), torch.tensor([2, 1]))  # row 0 meets EOS
    (accepted,) = seqs.read(torch.tensor([1, 0]))
    assert accepted == [1, 0] and seqs.host_active == [False, True] and seqs.host_lengths == [4, 4]
    seqs.append(torch.tensor([[1], [2]]), torch.tensor([1, 1]))  # stale now: the next question reads
    assert seqs.all_finished() and seqs.host_lengths == [4, 5]
    assert torch.equal(seqs.result(), torch.tensor([[3, 4, 5, 9, 0], [6, 7, 8, 1, 2]]))


@pytest.mark.parametrize("seed", range(4))
def test_append_one_equals_append_of_one_token(seed):
    """AR's ``append_one`` against ``append(token[:, None], ones)``: rows finishing on EOS, on the token budget
    and at the buffer's end, and rows already finished, appended again and again."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 6, (5, 4), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # a left-padded row
    both = [
        SequenceBatch(ids, mask, max_new_tokens=6, capacity=8, eos_token_ids=[3, 5], pad_token_id=0)
        for _ in range(2)
    ]
    for _ in range(8):
        token = torch.randint(1, 7, (5,), generator=gen)
        both[0].append(token[:, None], torch.ones_like(token))
        both[1].append_one(token)
        for name in ("tokens", "lengths", "finished"):
            assert torch.equal(getattr(both[0], name), getattr(both[1], name)), name
    assert both[1].all_finished() and both[1].finished.any()
