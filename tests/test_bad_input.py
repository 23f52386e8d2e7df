"""Bad input raises ValueError / SaguaroError naming the value and what is allowed."""

import pytest
import torch

import saguaro
from tests.conftest import tiny_pair
from tests.models import tiny_target, truncated_draft


@pytest.fixture(scope="module")
def pair():
    return tiny_pair("llama")


def test_vocabulary_mismatch(pair):
    target, _, _ = pair
    other = tiny_target("llama", vocab_size=100)
    with pytest.raises(ValueError, match="vocabulary mismatch.*128.*100"):
        saguaro.compile(target, other, backend="eager")


@pytest.mark.parametrize("k", [0, 17, -1, 2.5, True])
def test_k_outside_range(pair, k):
    target, draft, _ = pair
    with pytest.raises(ValueError, match=r"k=.*1\.\.16"):
        saguaro.compile(target, draft, k=k, backend="eager")


@pytest.mark.parametrize(
    "option, value, allowed",
    [
        ("mode", "beam", "ar, sd, ssd"),
        ("backend", "tvm", "eager, inductor"),
        ("fallback", "x", "auto, neural, fast"),
        ("saguaro_c", 0.0, r"\(0, 1\]"),
        ("fan_out", [1, 2], "k\\+1"),
        ("attention", "flash", "auto, op, inline, flex"),
        ("lane_timeout_s", 0, "> 0 seconds"),
        ("lane_start_timeout_s", -1.0, "> 0 seconds"),
        ("lane_start_timeout_s", "10", "> 0 seconds"),
    ],
)
def test_other_config_values(pair, option, value, allowed):
    target, draft, _ = pair
    with pytest.raises(ValueError, match=f"{option}=.*{allowed}"):
        saguaro.compile(target, draft, **{option: value})  # rejected before anything is built


def test_negative_temperature(pair):
    _, _, program = pair
    with pytest.raises(ValueError, match="temperature=-0.5.*>= 0"):
        program.generate(torch.tensor([[5, 6]]), temperature=-0.5)


def test_empty_input(pair):
    _, _, program = pair
    with pytest.raises(ValueError, match="empty"):
        program.generate(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match=r"rows \[1\] are empty"):
        program.generate(torch.tensor([[5, 6], [0, 0]]), attention_mask=torch.tensor([[1, 1], [0, 0]]))


def test_right_padding_is_refused(pair):
    _, _, program = pair
    with pytest.raises(ValueError, match="left padding"):
        program.generate(torch.tensor([[5, 6, 0]]), attention_mask=torch.tensor([[1, 1, 0]]))


def test_prompt_beyond_maximum_positions(pair):
    _, _, program = pair  # tiny models have max_position_embeddings 256
    with pytest.raises(ValueError, match="250 \\+ max_new_tokens 10 = 260 exceeds the maximum of 256"):
        program.generate(torch.full((1, 250), 5), max_new_tokens=10)


def test_prompt_beyond_kv_capacity(pair):
    target, draft, _ = pair
    program = saguaro.compile(target, draft, max_seq_len=32, backend="eager")
    with pytest.raises(ValueError, match="exceeds the maximum of 32"):
        program.generate(torch.full((1, 30), 5), max_new_tokens=8)


def test_token_ids_outside_vocabulary(pair):
    _, _, program = pair
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 128\)"):
        program.generate(torch.tensor([[5, 500]]))


@pytest.mark.parametrize("value", [0, -3, 1.5])
def test_invalid_max_new_tokens(pair, value):
    _, _, program = pair
    with pytest.raises(ValueError, match="max_new_tokens"):
        program.generate(torch.tensor([[5, 6]]), max_new_tokens=value)


def test_draft_with_another_dtype(pair):
    target, _, _ = pair
    draft = truncated_draft(target).to(torch.bfloat16)
    with pytest.raises(
        ValueError, match="draft dtype torch.bfloat16 differs from the target's torch.float32"
    ):
        saguaro.compile(target, draft, backend="eager")


def test_draft_on_another_device(pair):
    target, _, _ = pair
    draft = truncated_draft(target).to("meta")
    with pytest.raises(ValueError, match="draft is on device meta but the target is on cpu"):
        saguaro.compile(target, draft, backend="eager")


def test_sd_without_draft(pair):
    target, _, _ = pair
    with pytest.raises(ValueError, match="needs a draft"):
        saguaro.compile(target, None, mode="sd", backend="eager")
    program = saguaro.compile(target, None, mode="ar", backend="eager")
    with pytest.raises(ValueError, match="needs a draft"):
        program.generate(torch.tensor([[5, 6]]), mode="sd")


def test_not_a_module():
    with pytest.raises(saguaro.SaguaroError, match="target must be a Hugging Face causal LM module, got str"):
        saguaro.compile("gpt2", None, mode="ar", backend="eager")
