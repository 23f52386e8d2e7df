"""Families that mix attention layer kinds and add softcapping, sinks or their own scaling (Gemma 2,
Gemma 3, GPT-OSS; Llama 4's chunked layers): greedy ``ar``, ``sd`` and ``ssd`` equal the target's
own ``generate`` token for token, with prompts and generations longer than the sliding window (or
chunk), batch 1 and batch 3 left-padded."""

import functools

import pytest
import torch

import saguaro
from tests.models import FAMILIES, WINDOW, family_draft, prompts, reference_greedy, tiny_family_target

NEW_TOKENS = 24
SHAPES = {1: dict(batch=1, length=9, pad_rows=None), 3: dict(batch=3, length=9, pad_rows={1: 4, 2: 1})}


@functools.cache
def family_program(family: str):
    target = tiny_family_target(family)
    # a fixed tree, so every round exercises the tree mask (the planner may choose SD rounds)
    program = saguaro.compile(
        target,
        family_draft(target),
        k=4,
        mode="ssd",
        lane="thread",
        fan_out="geometric",
        backend="eager",
        sd_when_faster=False,
    )
    return target, program


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_ar_sd_ssd_equal_generate_past_the_window(family, batch):
    target, program = family_program(family)
    shape = SHAPES[batch]
    ids, mask = prompts(shape["batch"], shape["length"], seed=batch, pad_rows=shape["pad_rows"])
    expected = reference_greedy(target, ids, mask, max_new_tokens=NEW_TOKENS)
    # the window is really exercised: every row's real prompt (padding excluded) is longer than it, and
    # the generation runs past two more windows
    assert int(mask.sum(1).min()) > WINDOW and expected.shape[1] - ids.shape[1] > 2 * WINDOW
    for mode in ("ar", "sd", "ssd"):
        out = program.generate(
            ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, mode=mode, eos_token_id=None
        )
        assert torch.equal(out.sequences, expected), f"{family} {mode} diverged from target.generate"
    assert out.stats["rounds"] < NEW_TOKENS, "the draft's tokens were never accepted"
    assert sum(out.stats["hits_by_position"].values()) > 0, "the speculation cache never hit"


def test_the_gemma3_draft_mixes_kinds_too():
    """So the draft's glue and tree stages run with one mask per kind as well."""
    _, program = family_program("gemma3")
    assert len(set(program.draft.spec.layer_kinds)) == 2


def test_ignoring_the_window_would_be_caught(monkeypatch, no_capture_cache):
    """The exactness tests above bite: with the window dropped from the masks, AR already diverges."""
    from saguaro.capture import attention_op

    monkeypatch.setattr(attention_op, "kind_allows", lambda allowed, *args: allowed)
    target = tiny_family_target("gemma3")
    program = saguaro.compile(target, None, mode="ar", backend="eager", sd_when_faster=False)
    ids, mask = prompts(3, 9, seed=3, pad_rows={1: 4, 2: 1})
    out = program.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, eos_token_id=None)
    assert not torch.equal(out.sequences, reference_greedy(target, ids, mask, max_new_tokens=NEW_TOKENS))


@pytest.mark.parametrize(
    "family, change",
    [
        ("gemma2", dict(attn_logit_softcapping=None)),
        ("gemma2", dict(query_pre_attn_scalar=16)),
        ("gemma2", dict(layer_types=["full_attention"] * 2)),
        ("gemma3", dict(layer_types=["full_attention"] * 3)),
        ("gpt_oss", dict(layer_types=["full_attention"] * 2)),
        ("gpt_oss", "no sinks"),
        ("llama4", dict(layer_types=["full_attention"] * 2)),
    ],
)
def test_the_tiny_configs_exercise_their_variants(family, change):
    """Each variant changes the target's own greedy tokens, so equality above is evidence it is handled
    (final-logit softcapping is monotonic and cannot change greedy tokens: the sampled test covers it)."""
    ids, mask = prompts(3, 9, seed=3, pad_rows={1: 4, 2: 1})
    if change == "no sinks":
        other = tiny_family_target(family)
        with torch.no_grad():
            for layer in other.model.layers:
                layer.self_attn.sinks.fill_(-1e4)  # a sink that takes no share of the softmax
    else:
        other = tiny_family_target(family, **change)
    base = reference_greedy(tiny_family_target(family), ids, mask, NEW_TOKENS)
    assert not torch.equal(reference_greedy(other, ids, mask, NEW_TOKENS), base)
