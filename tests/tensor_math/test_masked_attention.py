"""The ``saguaro_kernels::masked_attention`` op equals SDPA with the same additive mask up to float rounding, on
the vector path's head sizes and the scalar loop's; ``attention="kernel"`` lowers SD's verify and the draft's
step to it, and greedy generation stays the target's own."""

import pytest
import torch

import saguaro
from saguaro.core.stages import DRAFT_CHAIN, DRAFT_STEP, STAGES, TARGET_VERIFY, TARGET_VERIFY_ROUND
from saguaro.lower.kernel_choice import KERNEL_ATTENTION, attention_implementation
from saguaro.passes.lower_attention import attention_kernel
from saguaro.passes.pipeline import build_stage
from saguaro.tensor_math.masked_attention import available, masked_attention
from tests.models import prompts, reference_greedy, tiny_target, truncated_draft
from tests.passes.stage_helpers import base_graph, count

pytestmark = pytest.mark.skipif(not available(), reason="the saguaro_kernels library does not build here")
NEG_INF = float("-inf")


@pytest.mark.parametrize(
    "groups,rows,head,slots,visible",
    [
        (6, 6, 64, 256, 150),  # a verify of the default target
        (4, 1, 32, 256, 37),  # a draft step
        (2, 13, 16, 40, 33),  # rows of two query heads per KV head
        (1, 3, 128, 9, 9),  # fewer slots than a block of eight
        (3, 5, 20, 19, 7),  # a head size off the vector path: the scalar loop
    ],
)
def test_equals_sdpa_with_the_same_mask(groups, rows, head, slots, visible):
    gen = torch.Generator().manual_seed(groups * 100 + rows)
    q, k, v = (torch.randn(2, groups, n, head, generator=gen) for n in (rows, slots, slots))
    bias = torch.zeros(2, 1, rows, slots)
    bias[..., visible:] = NEG_INF  # unused capacity
    bias[0, 0, 0, 2 % visible] = NEG_INF  # a hidden slot among visible ones
    bias[1, 0, -1, 0] = -3.5  # a finite bias
    scale = head**-0.5
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    out = masked_attention(q, k, v, bias, scale)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_a_row_that_sees_no_slot_gets_zeros_and_the_others_are_unaffected():
    q, k, v = torch.randn(1, 2, 3, 32), torch.randn(1, 2, 16, 32), torch.randn(1, 2, 16, 32)
    bias = torch.zeros(1, 1, 3, 16)
    bias[0, 0, 1] = NEG_INF
    out = masked_attention(q, k, v, bias, 0.2)
    assert torch.equal(out[:, :, 1], torch.zeros(1, 2, 32))
    expected = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, ::2], k, v, attn_mask=bias[:, :, ::2], scale=0.2
    )
    torch.testing.assert_close(out[:, :, ::2], expected, rtol=1e-5, atol=1e-6)


def test_kernel_is_chosen_for_the_verify_and_the_draft_step_on_cpu_where_it_builds():
    assert set(KERNEL_ATTENTION) == {*TARGET_VERIFY, TARGET_VERIFY_ROUND, *DRAFT_STEP, DRAFT_CHAIN}
    for stage in STAGES:
        picked = attention_implementation(
            "inductor", "auto", "cpu", stage.mask, stage=stage, kernel_built=True
        )
        assert (picked == "kernel") == (stage in KERNEL_ATTENTION), stage
        assert (
            attention_implementation("inductor", "auto", "cpu", stage.mask, stage=stage) != "kernel"
        )  # not built
        assert (
            attention_implementation("inductor", "auto", "cuda", stage.mask, stage=stage, kernel_built=True)
            != "kernel"
        )
        requested = attention_implementation("eager", "kernel", "cpu", stage.mask, stage=stage)
        assert requested == ("kernel" if stage in KERNEL_ATTENTION else "inline"), stage
        assert attention_implementation("eager", "kernel", "cuda", stage.mask, stage=stage) == "inline"
        eager = attention_implementation("eager", "auto", "cpu", stage.mask, stage=stage, kernel_built=True)
        assert eager == ("kernel" if stage in KERNEL_ATTENTION else "op"), stage  # eager: the op elsewhere
        assert attention_implementation("eager", "auto", "cpu", stage.mask, stage=stage) == "op"  # not built
        assert (
            attention_implementation("eager", "auto", "cuda", stage.mask, stage=stage, kernel_built=True)
            == "op"
        )


def test_the_lowered_verify_calls_the_kernel_in_every_layer():
    _, captured = base_graph()
    gm = build_stage(captured.graph_module, TARGET_VERIFY.greedy, 8, attention="kernel")
    assert count(gm, attention_kernel) == captured.spec.num_layers


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_sd_with_the_kernel_equals_the_targets_generate(arch):
    target = tiny_target(arch)
    program = saguaro.compile(
        target,
        truncated_draft(target),
        k=4,
        mode="sd",
        backend="eager",
        attention="kernel",
        sd_when_faster=False,
    )
    for seed, (batch, length, pad_rows) in enumerate([(1, 7, None), (3, 9, {1: 4, 2: 1})]):
        ids, mask = prompts(batch, length, seed=seed, pad_rows=pad_rows)
        out = program.generate(ids, attention_mask=mask, max_new_tokens=24, mode="sd", eos_token_id=None)
        assert torch.equal(out.sequences, reference_greedy(target, ids, mask, max_new_tokens=24))
