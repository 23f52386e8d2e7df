"""Shape buckets of the inductor backend: prompts left-padded to PROMPT_BUCKET columns (masked, and
dropped from the result), KV capacities rounded up to CAPACITY_BUCKET slots; eager is untouched."""

import torch

import saguaro
from saguaro.lower.lowering import CAPACITY_BUCKET, PROMPT_BUCKET, bucketed
from tests.models import tiny_target, truncated_draft


def test_bucketed_rounds_up_to_a_multiple():
    assert [bucketed(n, 16) for n in (1, 15, 16, 17, 32, 33)] == [16, 16, 16, 32, 32, 48]


def test_inductor_pads_prompts_and_capacities_to_buckets_and_eager_does_not():
    target = tiny_target("llama", seed=3)
    draft = truncated_draft(target)
    inductor = saguaro.compile(target, draft, k=3, mode="sd", backend="inductor", sd_when_faster=False)  # nothing compiles yet
    eager = saguaro.compile(target, draft, k=3, mode="sd", backend="eager", sd_when_faster=False)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [0, 0, 4, 5, 6, 7, 8]])
    mask = torch.tensor([[1] * 7, [0, 0, 1, 1, 1, 1, 1]])
    padded_ids, padded_mask = inductor.shapes.pad_prompt(ids, mask, inductor.pad_token_id)
    assert padded_ids.shape == (2, PROMPT_BUCKET) and padded_mask.shape == (2, PROMPT_BUCKET)
    assert torch.equal(padded_ids[:, -7:], ids) and torch.equal(padded_mask[:, -7:], mask)
    assert not bool(padded_mask[:, :-7].any())  # the added columns are masked padding
    same_ids, same_mask = eager.shapes.pad_prompt(ids, mask, eager.pad_token_id)
    assert same_ids is ids and same_mask is mask
    for tree in (False, True):  # the stores without and with SSD's tree scratch
        capacity = inductor._store_capacity(PROMPT_BUCKET, 20, tree)
        assert capacity % CAPACITY_BUCKET == 0 and capacity >= eager._store_capacity(PROMPT_BUCKET, 20, tree)
