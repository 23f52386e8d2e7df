"""Per-layer attention kinds: read from the config, one mask node per distinct kind, logits equal to
the HF forward over sequences longer than the window; refusals name the class and the reason."""

import pytest
import torch
from transformers import Llama4TextConfig, Qwen2Config

from saguaro.capture import capture, model_spec
from saguaro.capture.attention_op import ATTENTION_OP, MASK_OP, VARIANTS_OP
from saguaro.capture.layer_kinds import LayerKind, layer_kinds
from saguaro.core.errors import CaptureError
from saguaro.runtime.base.kv_store import KVStore
from tests.models import FAMILIES, WINDOW, tiny_config, tiny_family_config, tiny_family_target

FULL, SLIDING = LayerKind(), LayerKind(window=WINDOW)


def nodes(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def test_layer_kinds_follow_layer_types_and_family_equivalents():
    assert layer_kinds(tiny_family_config("gemma3"), 3) == (SLIDING, FULL, SLIDING)
    assert layer_kinds(tiny_family_config("gpt_oss"), 2) == (SLIDING, FULL)
    assert layer_kinds(tiny_config("mistral"), 2) == (LayerKind(window=4096),) * 2  # no layer_types: one kind
    assert layer_kinds(tiny_config("llama"), 2) == (FULL, FULL)
    qwen2 = Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    assert layer_kinds(qwen2, 3) == (FULL, LayerKind(window=6), LayerKind(window=6))
    assert layer_kinds(Qwen2Config(num_hidden_layers=2, use_sliding_window=False), 2) == (FULL, FULL)
    llama4 = Llama4TextConfig(num_hidden_layers=4, attention_chunk_size=8, no_rope_layers=[1, 1, 1, 0])
    assert LayerKind(chunk=8) in layer_kinds(llama4, 4) and FULL in layer_kinds(llama4, 4)


def test_unsupported_kinds_are_refused_naming_class_and_kind():
    config = tiny_family_config("gemma3")
    config.layer_types = ["sliding_attention", "linear_attention", "full_attention"]
    with pytest.raises(CaptureError, match="Gemma3TextConfig: layer 1 has attention kind 'linear_attention'"):
        layer_kinds(config, 3)
    config = Qwen2Config(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(
        CaptureError, match="Qwen2Config: layer 0 is sliding_attention but the config has no sliding"
    ):
        layer_kinds(config, 2)  # use_sliding_window=False leaves no window
    config = tiny_family_config("gemma3", use_bidirectional_attention=True)
    with pytest.raises(
        CaptureError, match="Gemma3TextConfig: use_bidirectional_attention=True is not causal"
    ):
        layer_kinds(config, 3)


def test_one_mask_node_per_kind_and_each_layer_reads_its_own():
    captured = capture(tiny_family_target("gemma3"))
    gm = captured.graph_module
    masks = nodes(gm, MASK_OP)
    assert sorted((n.args[6], n.args[7]) for n in masks) == [(0, 0), (WINDOW, 0)]  # (window, chunk)
    windows = [node.args[6].args[6] for node in nodes(gm, ATTENTION_OP)]  # the bias each layer reads
    assert windows == [WINDOW, 0, WINDOW]
    assert captured.spec.layer_kinds == (SLIDING, FULL, SLIDING)


def test_attention_variants_reach_the_op():
    """Layers with a softcap or sinks use the variants op; the others keep the plain op's short schema."""
    gemma2 = nodes(capture(tiny_family_target("gemma2")).graph_module, VARIANTS_OP)
    assert [n.args[8] for n in gemma2] == [1.0, 1.0]  # attn_logit_softcapping
    assert all(n.args[7] == pytest.approx(24**-0.5) for n in gemma2)  # query_pre_attn_scalar, not head_dim
    assert all(n.args[9] is None for n in gemma2)
    plain = capture(tiny_family_target("gemma3")).graph_module
    assert len(nodes(plain, ATTENTION_OP)) == 3 and not nodes(plain, VARIANTS_OP)
    gpt_oss = nodes(capture(tiny_family_target("gpt_oss")).graph_module, VARIANTS_OP)
    assert len(gpt_oss) == 2
    assert all(n.args[8] == 0.0 and isinstance(n.args[9], torch.fx.Node) for n in gpt_oss)  # the sinks


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


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_hf_forward_past_the_window(family):
    model = tiny_family_target(family)
    captured = capture(model)
    store = KVStore(captured.spec, batch=2, capacity=24)
    ids = torch.randint(3, 128, (2, 14), generator=torch.Generator().manual_seed(0))  # 14 > 3 windows
    with torch.no_grad():
        expected = model(ids).logits
        got = [
            run(captured, store, ids[:, :7], 0),
            run(captured, store, ids[:, 7:8], 7),
            run(captured, store, ids[:, 8:], 8),
        ]  # KV written by one call persists for the next
    torch.testing.assert_close(torch.cat(got, 1), expected, rtol=1e-4, atol=1e-5)


def test_a_softcap_that_sdpa_drops_is_dropped_and_one_it_refuses_is_kept():
    """Gemma 2 loaded with SDPA: where this transformers' SDPA ignores the softcap (5.17), the model's own
    forward computes without it and so does the capture; where SDPA refuses it (the forward raises), the
    capture keeps the softcap of the model's definition (its eager forward)."""
    from saguaro.capture.hf_hook import sdpa_drops_softcap

    model = tiny_family_target("gemma2")
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        softcapped = model(ids).logits  # eager attention
        model.config._attn_implementation_internal = "sdpa"
        try:
            as_loaded = model(ids).logits
        except Exception:
            as_loaded = None
        captured = capture(model)
        store = KVStore(captured.spec, batch=2, capacity=16)
        got = run(captured, store, ids, 0)
    assert sdpa_drops_softcap() == (as_loaded is not None)
    assert not torch.allclose(softcapped, as_loaded if as_loaded is not None else softcapped * 0, atol=1e-3)
    torch.testing.assert_close(got, softcapped if as_loaded is None else as_loaded, rtol=1e-4, atol=1e-5)


def test_a_layer_whose_window_disagrees_with_its_config_is_refused():
    model = tiny_family_target("gemma2")
    model.model.layers[0].self_attn.sliding_window = WINDOW + 1
    with pytest.raises(CaptureError, match=r"Gemma2Attention \(layer 0\) attends with sliding_window=5"):
        capture(model)


def test_llama4_temperature_tuning_limits_the_sequence_length():
    """Its NoPE layers' query scale needs the HF cache's length past floor_scale: saguaro stops before."""
    assert model_spec(tiny_family_target("llama4", max_position_embeddings=1 << 14)).max_positions == 8191
    assert layer_kinds(tiny_family_config("llama4"), 2) == (LayerKind(chunk=WINDOW), FULL)
    untuned = tiny_family_target("llama4", max_position_embeddings=1 << 14, attn_temperature_tuning=False)
    assert model_spec(untuned).max_positions == 1 << 14


def test_families_outside_the_attention_interface_and_bidirectional_ones_are_refused():
    from transformers import FalconConfig, FalconForCausalLM

    falcon = FalconForCausalLM(
        FalconConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=128)
    ).eval()
    with pytest.raises(
        CaptureError, match="FalconForCausalLM does not route attention through .*AttentionInterface"
    ):
        capture(falcon)
    with pytest.raises(CaptureError, match="use_bidirectional_attention=True is not causal"):
        capture(tiny_family_target("gemma3", use_bidirectional_attention=True))


def test_sinks_the_attention_call_does_not_pass_are_refused(monkeypatch, no_capture_cache):
    from saguaro.capture import hf_hook

    forward = hf_hook.saguaro_attention_forward

    def without_sinks(module, *args, **kwargs):
        kwargs.pop("s_aux", None)  # a family whose module has sinks its attention call does not pass
        return forward(module, *args, **kwargs)

    monkeypatch.setattr(hf_hook, "saguaro_attention_forward", without_sinks)  # capture registers it
    try:
        with pytest.raises(
            CaptureError, match=r"GptOssAttention \(layer 0\) has attention sinks that its attention"
        ):
            capture(tiny_family_target("gpt_oss"))
    finally:
        monkeypatch.undo()
        hf_hook.register_attention()  # the real implementation again, for the tests that follow
