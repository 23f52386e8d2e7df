"""A cached branch equals a fresh draft decode of the same prefix: tokens and distributions."""

import pytest
import torch

from saguaro.runtime.draft import tree
from tests.conftest import tiny_pair


def prepare(arch, k=3, fan_out=(2, 1, 1, 3), temperature=0.0, saguaro_c=1.0):
    _, draft_model, program = tiny_pair(arch)
    draft = program.draft
    prompt = torch.tensor([[5, 9, 17, 33, 41, 8]])
    spec = torch.tensor([[12, 77, 3, 64]])  # r, x_1..x_3
    T = prompt.shape[1]
    store = draft.new_store(1, 64)
    index = torch.arange(T)[None]
    draft(store, prompt, index, index)
    full_index = torch.arange(T, T + k + 1)[None]
    request = tree.GlueRequest(
        ids=spec,
        index=full_index,
        positions=full_index,
        fan_out=list(fan_out),
        temperature=temperature,
        saguaro_c=saguaro_c,
    )
    gen = torch.Generator().manual_seed(0) if temperature > 0 else None
    cache = tree.build_speculations(draft, store, request, gen)
    return draft_model, prompt, spec, cache


def fresh_distributions(draft_model, tokens, temperature):
    """The draft's own forward over the whole prefix: distributions after every position."""
    with torch.no_grad():
        logits = draft_model(tokens).logits[0].float()  # [L, V]
    return torch.softmax(logits / (temperature or 1.0), dim=-1)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cached_branches_equal_fresh_greedy_decode(arch):
    k = 3
    draft_model, prompt, spec, cache = prepare(arch, k=k)
    MQ = cache.candidates.shape[1]
    assert MQ == 7 and cache.tokens.shape == (1, MQ, k)
    for b in range(MQ):
        j = int(cache.branch_rows[b])
        c = cache.candidates[0, b]
        prefix = torch.cat([prompt[0], spec[0, : j + 1], c[None]])  # ... r x_1..x_j c
        tokens = prefix.clone()
        for _ in range(k):  # fresh greedy decode with the HF draft itself
            nxt = fresh_distributions(draft_model, tokens[None], 0.0)[-1].argmax()
            tokens = torch.cat([tokens, nxt[None]])
        assert torch.equal(cache.tokens[0, b], tokens[prefix.numel() :]), f"branch {b} (j={j}) differs"
    assert cache.probs is None  # greedy verification needs no distributions; sampled ones are tested below


def test_fork_excludes_the_speculated_token_and_ranks_by_draft_probability():
    draft_model, prompt, spec, cache = prepare("llama")
    glue = fresh_distributions(draft_model, torch.cat([prompt, spec], 1), 0.0)[prompt.shape[1] :]  # [k+1, V]
    for b in range(cache.candidates.shape[1]):
        j = int(cache.branch_rows[b])
        c = int(cache.candidates[0, b])
        if j < spec.shape[1] - 1:
            assert c != int(spec[0, j + 1])
            row = glue[j].clone()
            row[spec[0, j + 1]] = -1
        else:
            row = glue[j]
        rank = int((cache.branch_rows[:b] == j).sum())
        assert c == int(row.topk(rank + 1).indices[rank])


def test_cached_sampled_branches_carry_their_true_distributions():
    """At temperature > 0 with Saguaro sampling, each cached distribution is q' of the fresh q."""
    from saguaro.tensor_math.fork import saguaro_distribution

    fan_out = (2, 1, 1, 3)
    draft_model, prompt, spec, cache = prepare("llama", temperature=0.8, saguaro_c=0.5, fan_out=fan_out)
    for b in range(cache.candidates.shape[1]):
        j = int(cache.branch_rows[b])
        tokens = torch.cat([prompt[0], spec[0, : j + 1], cache.candidates[0, b, None], cache.tokens[0, b]])
        q = fresh_distributions(draft_model, tokens[None], 0.8)[-4:-1]  # after c, y_1, y_2: [k, V]
        expected = torch.stack([saguaro_distribution(q[d], fan_out[d], 0.5) for d in range(3)])
        torch.testing.assert_close(cache.probs[0, b], expected, rtol=1e-4, atol=1e-5)


def test_a_round_without_branches_forks_two_unused_candidates(monkeypatch):
    """No branches (an SD round): the glue still forks, two candidates (``tree.UNUSED_FORK``; one would be a
    size a compiler keeps static, a compile of its own), and the cache holds none of them."""
    from saguaro.core.stages import DRAFT_GLUE
    from saguaro.runtime.base.model_runner import ModelRunner

    forked = []
    real_run = ModelRunner.run

    def run(self, stage, *args):
        if stage is DRAFT_GLUE:
            forked.append(args[-2].numel())  # branch_rows [MQ]
        return real_run(self, stage, *args)

    monkeypatch.setattr(ModelRunner, "run", run)
    _, _, _, cache = prepare("llama", fan_out=(0, 0, 0, 0))
    assert forked == [2] and cache.candidates.shape[1] == 0 and cache.branch_rows.numel() == 0
