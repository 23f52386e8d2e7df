"""Capture: one saguaro attention node per layer, results equal to the HF model's own forward."""

import pytest
import torch

from saguaro.capture import capture
from saguaro.capture.attention_op import ATTENTION_OP
from saguaro.core.errors import CaptureError, SaguaroError
from saguaro.runtime.base.kv_store import KVStore
from tests.models import ARCHITECTURES, LlamaForCausalLM, tiny_config, tiny_target


def attention_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is ATTENTION_OP]


def run(captured, store, ids, start):
    B, T = ids.shape
    index = torch.arange(start, start + T).expand(B, T).contiguous()
    store.claim(index, index, torch.zeros_like(index))
    return captured.graph_module(
        ids,
        index,
        index,
        torch.zeros_like(index),
        index,
        store.slot_pos,
        store.slot_branch,
        store.k_caches,
        store.v_caches,
    )


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_one_attention_node_per_layer_and_no_hf_cache(arch):
    model = tiny_target(arch, layers=3)
    captured = capture(model)
    gm = captured.graph_module
    assert len(attention_nodes(gm)) == 3
    # the op mutates the KV store in place: no functionalized copies of the caches
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert not any("auto_functionalized" in t or "copy_" in t for t in targets)
    assert model.config._attn_implementation != "saguaro", (
        "capture must restore the model's attention setting"
    )


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_logits_equal_hf_forward_across_calls(arch):
    model = tiny_target(arch)
    captured = capture(model)
    store = KVStore(captured.spec, batch=2, capacity=24)
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
        got_prefill = run(captured, store, ids[:, :7], 0)  # KV written here must persist ...
        got_step = run(captured, store, ids[:, 7:10], 7)  # ... for these calls
        got_last = run(captured, store, ids[:, 10:], 10)
    torch.testing.assert_close(
        torch.cat([got_prefill, got_step, got_last], 1), expected, rtol=1e-4, atol=1e-5
    )


def test_unsupported_module_raises_naming_the_class():
    with pytest.raises(SaguaroError, match="Sequential"):
        capture(torch.nn.Sequential(torch.nn.Linear(4, 4)))


class NoInterfaceLlama(LlamaForCausalLM):
    """A model whose attention does not go through AttentionInterface."""

    _supports_attention_backend = False


def test_model_without_attention_interface_raises_capture_error():
    model = NoInterfaceLlama(tiny_config("llama")).eval()
    with pytest.raises(CaptureError, match="NoInterfaceLlama.*AttentionInterface"):
        capture(model)
