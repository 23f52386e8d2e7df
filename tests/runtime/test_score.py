"""``Program.score``: the target's log-probabilities of a sequence's tokens are ``transformers``' own
(``torch.log_softmax(model(ids).logits.float(), -1)``, within 1e-4 in float32), row by row in a left-padded batch,
with the best ``top`` tokens at each position; bad input is refused as ``generate`` refuses it."""

import math

import pytest
import torch

from saguaro.artifact.signature import varying_dims
from saguaro.core.errors import ConfigError
from saguaro.core.stages import TARGET_SCORE
from tests.conftest import tiny_pair
from tests.models import PAD, prompts

TOL = 1e-4


def hf_logprobs(model, ids: list) -> torch.Tensor:
    """``[T, V]``: transformers' float32 log-softmax of the model's logits over ``ids`` alone (no padding)."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits.float(), dim=-1)[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_score_is_transformers_log_softmax_row_by_row_in_a_left_padded_batch(arch):
    target, _, program = tiny_pair(arch)
    ids, mask = prompts(2, 12, seed=21, pad_rows={1: 4})  # row 1: 4 padding columns, then 8 tokens
    out = program.score(ids, attention_mask=mask, top=3)
    assert out.token_logprobs.shape == (2, 12) and out.token_logprobs.dtype == torch.float32
    assert out.top_ids.shape == out.top_logprobs.shape == (2, 12, 3)
    for row, pad in ((0, 0), (1, 4)):
        real = ids[row, pad:].tolist()
        want = hf_logprobs(target, real)  # [T - pad, V]
        expected = want[:-1].gather(-1, torch.tensor(real[1:])[:, None]).squeeze(-1)  # [T - pad - 1]
        got = out.token_logprobs[row, pad + 1 :]
        assert (got - expected).abs().max().item() < TOL, (arch, row)
        shifted = want[1:].gather(-1, torch.tensor(real[1:])[:, None]).squeeze(-1)  # one position off
        assert (got - shifted).abs().max().item() > 100 * TOL  # the check above tells positions apart
        values, best = want[:-1].topk(3, dim=-1)  # [T - pad - 1, 3]
        assert torch.equal(out.top_ids[row, pad + 1 :], best), (arch, row)
        assert (out.top_logprobs[row, pad + 1 :] - values).abs().max().item() < TOL
        assert bool((out.top_logprobs[row, pad + 1 :].diff(dim=-1) <= 0).all())  # the most likely first
        # nothing precedes the first real token; padding is not scored
        assert all(math.isnan(v) for v in out.token_logprobs[row, : pad + 1].tolist())
        assert bool((out.top_ids[row, : pad + 1] == -1).all()) and bool(
            out.top_logprobs[row, : pad + 1].isnan().all()
        )


def test_a_one_dimensional_prompt_without_top_scores_alone():
    target, _, program = tiny_pair("llama")
    ids = prompts(1, 9, seed=22)[0][0]  # [T]
    out = program.score(ids)
    assert out.token_logprobs.shape == (1, 9) and out.top_ids.shape == (1, 9, 0)
    want = hf_logprobs(target, ids.tolist())[:-1].gather(-1, ids[1:, None]).squeeze(-1)
    assert (out.token_logprobs[0, 1:] - want).abs().max().item() < TOL
    assert math.isnan(out.token_logprobs[0, 0].item())
    single = program.score(ids[:1], top=2)  # one token: nothing to score, nothing to rank
    assert math.isnan(single.token_logprobs.item()) and single.top_ids.tolist() == [[[-1, -1]]]


@pytest.mark.parametrize(
    "bad,words",
    [
        (torch.zeros(1, 0, dtype=torch.long), "empty"),
        (torch.tensor([[5, 128]]), "outside the vocabulary [0, 128)"),
        (torch.tensor([[5, -1]]), "outside the vocabulary"),
        (torch.full((1, 257), 5), "257 tokens"),
        (torch.tensor([[5.0, 6.0]]), "integer token ids"),
        ([5, 6], "LongTensor"),
    ],
)
def test_bad_input_is_refused_naming_it(bad, words):
    _, _, program = tiny_pair("llama")
    with pytest.raises(ValueError) as caught:
        program.score(bad)
    assert words in str(caught.value)


def test_bad_top_and_right_padding_are_refused():
    _, _, program = tiny_pair("llama")
    ids = torch.tensor([[5, 6, 7]])
    for top in (-1, 129, 1.5, True):
        with pytest.raises(ValueError, match=rf"top={top!r} is not allowed: it must be an int 0\.\.128"):
            program.score(ids, top=top)
    with pytest.raises(ValueError, match="left padding"):
        program.score(torch.tensor([[5, 6, PAD]]), attention_mask=torch.tensor([[1, 1, 0]]))


def test_a_target_without_the_score_stage_says_logprobs_need_a_compiled_program(monkeypatch):
    _, _, program = tiny_pair("llama")
    assert program.can_score
    monkeypatch.setattr(
        program.target, "provides", lambda stage: stage is not TARGET_SCORE
    )  # as an artifact's
    assert not program.can_score
    with pytest.raises(ConfigError, match="cannot score tokens.*saguaro.compile"):
        program.score(torch.tensor([[5, 6, 7]]))


def test_the_score_stage_is_compiled_dynamic_in_its_tokens_and_slots():
    """What Inductor and export mark dynamic for it (compiling a stage here would cost a minute of CPU): the query's
    tokens ``T`` and the store's slots ``S``, as the prefill's."""
    _, _, program = tiny_pair("llama")
    layers = program.target.spec.num_layers
    dims = varying_dims(TARGET_SCORE, 7 + 2 * layers)
    assert all(
        dims[i] == (1,) for i in range(7)
    )  # input_ids, positions, write_slots, branch, limit, slot_pos/branch
    assert all(dims[7 + i] == (2,) for i in range(2 * layers))  # the caches' slots
