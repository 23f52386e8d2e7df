"""quantize_weights and ``SaguaroConfig.weights``: every linear becomes ``saguaro::quantized_linear`` over panels
held once; greedy SD and SSD equal the quantized target's own AR (and ``generate`` of the model whose weights
are the dequantized ones) on three families, through the aten form (eager) and the packed kernel; bad values
and a second quantization are refused by name."""

import copy

import pytest
import torch

import saguaro
from saguaro.capture import capture
from saguaro.core.errors import ConfigError
from saguaro.passes import run_pipeline
from saguaro.passes.base.graph_splice import PassError
from saguaro.passes.quantize_weights import ATTRIBUTE_PREFIX, QuantizeWeights, quantize_weights
from saguaro.tensor_math import packed_linear as pl
from saguaro.tensor_math.quantized_linear import QUANTIZED_LINEAR, dequantize, quantize
from tests.models import (
    family_draft,
    prompts,
    reference_greedy,
    tiny_family_target,
    tiny_target,
    truncated_draft,
)

LINEAR = torch.ops.aten.linear.default


def _pair(family: str):
    if family == "gemma2":
        target = tiny_family_target(family, logit_scale=4.0)
        return target, family_draft(target)
    target = tiny_target(family, hidden=128, logit_scale=4.0)
    return target, truncated_draft(target)


def _dequantized(model, kind: str):
    """A copy of ``model`` whose every linear weight is its quantized value (what the quantized stages compute)."""
    bits, copied = {"int8": 8, "int4": 4}[kind], copy.deepcopy(model)
    with torch.no_grad():
        for module in copied.modules():
            if isinstance(module, torch.nn.Linear):
                group = None if bits == 8 else 64
                module.weight.copy_(dequantize(*quantize(module.weight, bits, group)))
    return copied


def test_every_linear_becomes_the_quantized_op_over_panels_held_once():
    model = tiny_target("llama", hidden=128)
    captured = capture(model)
    gm = run_pipeline(captured.graph_module, (QuantizeWeights("int4"),))
    ops = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert not any(n.target is LINEAR for n in ops)
    quantized = [n for n in ops if n.target is QUANTIZED_LINEAR]
    assert len(quantized) == 2 * 7 + 1  # q, k, v, o, gate, up, down a layer, and the head
    held = dict(gm.named_buffers())
    packed = {name: t for name, t in held.items() if name.startswith(ATTRIBUTE_PREFIX)}
    assert {t.dtype for t in packed.values()} == {torch.uint8, torch.float32}  # nibbles and their scales
    assert not any(name.endswith("proj.weight") for name, _ in gm.named_parameters())  # float weights dropped
    with pytest.raises(PassError, match="already quantized"):
        quantize_weights(gm, "int8")


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("linears", ["gemm", "packed"])
def test_greedy_sd_and_ssd_equal_the_quantized_targets_ar_and_generate(family, kind, linears):
    if linears == "packed" and not pl.available():
        pytest.skip("the packed kernel could not be built here")
    target, draft = _pair(family)
    ids, mask = prompts(2, 7)
    want = reference_greedy(_dequantized(target, kind), ids, mask, 12)
    program = saguaro.compile(target, draft, k=3, mode="sd", backend="eager", weights=kind, linears=linears)
    for mode in ("ar", "sd", "ssd"):
        got = program.generate(ids, attention_mask=mask, max_new_tokens=12, mode=mode).sequences
        assert torch.equal(got, want), (mode, got, want)
    program.close()


def test_the_draft_alone_can_be_quantized_and_the_users_model_is_untouched():
    target, draft = _pair("llama")
    before = {name: p.clone() for name, p in draft.named_parameters()}
    ids, mask = prompts(1, 6)
    want = reference_greedy(target, ids, mask, 10)  # the target as loaded: draft quantization keeps it exact
    program = saguaro.compile(target, draft, k=3, mode="sd", backend="eager", draft_weights="int4")
    assert torch.equal(program.generate(ids, attention_mask=mask, max_new_tokens=10).sequences, want)
    program.close()
    assert all(torch.equal(p, before[name]) for name, p in draft.named_parameters())


@pytest.mark.parametrize(
    "config, match",
    [
        (dict(weights="int3"), "weights='int3' is not allowed"),
        (dict(draft_weights="fp8"), "draft_weights='fp8' is not allowed"),
        (dict(weights="int8", weight_group_size=0), "weight_group_size=0 is not allowed"),
    ],
)
def test_bad_weight_options_are_refused_by_name(config, match):
    with pytest.raises(ConfigError, match=match):
        saguaro.compile(tiny_target("llama"), None, mode="ar", backend="eager", **config)


def test_a_group_size_that_does_not_divide_a_width_names_the_weight():
    with pytest.raises(
        ValueError, match=r"weight_group_size=48 cannot quantize .*q_proj.* \[64, 64\].*does not divide"
    ):
        saguaro.compile(
            tiny_target("llama"), None, mode="ar", backend="eager", weights="int8", weight_group_size=48
        )


@pytest.mark.heavy
@pytest.mark.skipif(not pl.available(), reason="the packed kernel could not be built here")
def test_inductor_runs_quantized_weights_on_the_packed_kernel_and_stays_exact():
    """Inductor's stages on a CPU read the int4 panels through ``packed_linear_q`` (no dequantized copy), and
    greedy AR, SD and SSD still give ``generate``'s tokens for the dequantized model."""
    target, draft = _pair("qwen2")
    ids, mask = prompts(2, 7)
    want = reference_greedy(_dequantized(target, "int4"), ids, mask, 12)
    program = saguaro.compile(target, draft, k=3, mode="sd", backend="inductor", weights="int4")
    for mode in ("ar", "sd", "ssd"):
        got = program.generate(ids, attention_mask=mask, max_new_tokens=12, mode=mode).sequences
        assert torch.equal(got, want), (mode, got, want)
    graphs = [gm for _, gm in program.runner("target").stage_graphs()]
    assert graphs, "no stage graph to look at"
    for gm in graphs:  # every stage, the prefill's included, on the kernel
        targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
        assert (
            torch.ops.saguaro_kernels.packed_linear_q.default in targets and QUANTIZED_LINEAR not in targets
        )
    program.close()
