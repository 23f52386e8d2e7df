"""Shape buckets of the inductor backend: prompts left-padded (masked, and dropped from the result) to
PROMPT_BUCKET columns on CUDA and to MIN_PROMPT_COLUMNS on the CPU, KV capacities rounded up to
CAPACITY_BUCKET slots; eager is untouched."""

import pytest
import torch

import saguaro
from saguaro.artifact.signature import varying_dims
from saguaro.core.errors import ArtifactError
from saguaro.core.stages import DRAFT_GLUE, DRAFT_TREE, TARGET_PREFILL, TARGET_VERIFY
from saguaro.lower.lowering import (
    CAPACITY_BUCKET,
    MIN_PROMPT_COLUMNS,
    PROMPT_BUCKET,
    ShapePolicy,
    bucketed,
    shape_policy,
)
from tests.models import prompts, reference_greedy, tiny_target, truncated_draft


def test_bucketed_rounds_up_to_a_multiple():
    assert [bucketed(n, 16) for n in (1, 15, 16, 17, 32, 33)] == [16, 16, 16, 32, 32, 48]


def test_the_policy_of_each_backend_and_device():
    assert shape_policy("inductor", "cuda") == ShapePolicy(PROMPT_BUCKET, CAPACITY_BUCKET)
    assert shape_policy("inductor", "cpu") == ShapePolicy(1, CAPACITY_BUCKET, MIN_PROMPT_COLUMNS)
    assert shape_policy("eager", "cuda") == shape_policy("eager", "cpu") == ShapePolicy()
    cuda = shape_policy("inductor", "cuda")
    ids, mask = torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long)
    padded_ids, padded_mask = cuda.pad_prompt(ids, mask, 0)
    assert padded_ids.shape == (1, PROMPT_BUCKET) and torch.equal(padded_ids[:, -3:], ids)
    assert int(padded_mask.sum()) == 3


def test_inductor_pads_prompts_and_capacities_to_buckets_and_eager_does_not():
    target = tiny_target("llama", seed=3)
    draft = truncated_draft(target)
    inductor = saguaro.compile(
        target, draft, k=3, mode="sd", backend="inductor", sd_when_faster=False
    )  # nothing compiles yet
    eager = saguaro.compile(target, draft, k=3, mode="sd", backend="eager", sd_when_faster=False)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [0, 0, 4, 5, 6, 7, 8]])
    mask = torch.tensor([[1] * 7, [0, 0, 1, 1, 1, 1, 1]])
    unpadded_ids, unpadded_mask = inductor.shapes.pad_prompt(ids, mask, inductor.pad_token_id)  # on the CPU
    assert unpadded_ids is ids and unpadded_mask is mask
    one, one_mask = torch.tensor([[5]]), torch.ones(1, 1, dtype=torch.long)
    padded_ids, padded_mask = inductor.shapes.pad_prompt(one, one_mask, inductor.pad_token_id)
    assert padded_ids.shape == (1, MIN_PROMPT_COLUMNS) and padded_mask.shape == (1, MIN_PROMPT_COLUMNS)
    assert torch.equal(padded_ids[:, -1:], one) and torch.equal(padded_mask[:, -1:], one_mask)
    assert not bool(padded_mask[:, :-1].any())  # the added columns are masked padding
    same_ids, same_mask = eager.shapes.pad_prompt(one, one_mask, eager.pad_token_id)
    assert same_ids is one and same_mask is one_mask
    for tree in (False, True):  # the stores without and with SSD's tree scratch
        capacity = inductor._store_capacity(7, 20, tree)
        assert capacity % CAPACITY_BUCKET == 0 and capacity >= eager._store_capacity(7, 20, tree)


def test_the_varying_dimensions_of_each_stage_layout():
    layers = 2
    prefill, verify = (
        varying_dims(TARGET_PREFILL, 7 + 2 * layers),
        varying_dims(TARGET_VERIFY.greedy, 7 + 2 * layers + len(TARGET_VERIFY.greedy.inputs)),
    )
    assert prefill == {
        **{i: (1,) for i in range(7)},
        **{7 + i: (2,) for i in range(2 * layers)},
    }  # T, S; caches' S
    assert verify == {
        5: (1,),
        6: (1,),
        **{7 + i: (2,) for i in range(2 * layers)},
    }  # K+1 query tokens: static
    tree = DRAFT_TREE.sampled  # inputs: inv_temperature, top, saguaro_c, u [B, MQ]
    assert varying_dims(tree, 11 + 2 * layers) == {
        **{i: (1,) for i in range(7)},
        **{7 + i: (2,) for i in range(2 * layers)},
        10 + 2 * layers: (1,),
    }
    glue = varying_dims(
        DRAFT_GLUE, 10 + 2 * layers
    )  # draft_tokens [B, K], branch_rows [MQ], branch_ranks [MQ]
    assert 0 not in glue and glue[8 + 2 * layers] == (0,) and glue[9 + 2 * layers] == (0,)
    with pytest.raises(ArtifactError, match="8 inputs do not fit"):
        varying_dims(TARGET_PREFILL, 8)


def test_a_stage_compiles_once_for_every_prompt_length_and_kv_capacity():
    """Query length and KV slots are dynamic from the first compile: prompts of three lengths (one token
    among them, padded to MIN_PROMPT_COLUMNS) and two capacity buckets compile the prefill and the step once
    each (more when the first is static, or a one-column prompt specialises), and the tokens stay the
    target's greedy tokens."""
    from torch._dynamo.utils import counters

    target = tiny_target("llama", seed=3)
    program = saguaro.compile(target, None, mode="ar", backend="inductor")
    counters.clear()
    for length, new_tokens in ((5, 8), (2 * PROMPT_BUCKET - 3, 2 * CAPACITY_BUCKET - 30), (1, 8)):
        ids, mask = prompts(1, length, seed=length)
        columns = max(length, MIN_PROMPT_COLUMNS)
        slots = columns + new_tokens + program.config.k + 2  # the last round's speculation and r after it
        assert program._store_capacity(columns, new_tokens) == bucketed(slots, CAPACITY_BUCKET)
        out = program.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, eos_token_id=None)
        assert torch.equal(out.sequences, reference_greedy(target, ids, mask, new_tokens))
    assert counters["stats"]["unique_graphs"] == 2  # target.prefill and target.step
