"""SD's first draft call feeds one token when the last round's outcome allows it (``DecodeState.draft_feed``):
each round's speculation is still the draft's own greedy continuation of the committed sequence."""

import torch

import saguaro
import saguaro.runtime.decode.sd as sd
from tests.models import prompts, reference_greedy, tiny_target, truncated_draft

NOISE = 0.3


def test_every_speculation_is_the_drafts_greedy_continuation(monkeypatch):
    target = tiny_target("llama")
    draft = truncated_draft(
        target, layers=2, noise=NOISE
    )  # the target, perturbed: rounds accept all k or fewer
    program = saguaro.compile(target, draft, k=4, mode="sd", backend="eager", sd_when_faster=False)
    k = program.config.k
    rounds = []  # (committed ids [1, L], draft_feed, speculation [1, k])
    speculate = sd.draft_speculation

    def recorded(runner, state):
        committed = state.seqs.result()  # [1, L]: every decided token, the pending one last
        feed = state.draft_feed
        tokens, probs = speculate(runner, state)
        rounds.append((committed, feed, tokens.clone()))
        return tokens, probs

    monkeypatch.setattr(sd, "draft_speculation", recorded)
    ids, mask = prompts(1, 6, seed=5)
    out = program.generate(ids, attention_mask=mask, max_new_tokens=40, mode="sd", eos_token_id=None)
    assert torch.equal(out.sequences, reference_greedy(target, ids, mask, max_new_tokens=40))
    feeds = [feed for _, feed, _ in rounds]
    assert 1 in feeds and 2 in feeds[1:], f"both feeds must occur after the first round: {feeds}"
    for committed, feed, tokens in rounds:
        expected = reference_greedy(draft, committed, torch.ones_like(committed), max_new_tokens=k)[:, -k:]
        assert torch.equal(tokens, expected), (
            f"feed {feed}: speculation {tokens} is not the draft's own {expected}"
        )
