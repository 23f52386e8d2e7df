"""Tiny random Hugging Face models built from configs (tests never download)."""

from __future__ import annotations

import copy
import functools

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}

PAD, BOS, EOS = 0, 1, 2


def tiny_config(
    arch: str, vocab_size: int = 128, layers: int = 2, hidden: int = 64, max_positions: int = 256
):
    config_cls, _ = ARCHITECTURES[arch]
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        tie_word_embeddings=False,
    )
    if arch == "qwen3":
        kwargs["head_dim"] = hidden // 4
    return config_cls(**kwargs)


def tiny_target(arch: str, seed: int = 0, logit_scale: float = 1.0, **config_kwargs) -> torch.nn.Module:
    """A random target; ``logit_scale`` sharpens its distributions (random init is near uniform)."""
    config_cls, model_cls = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    model = model_cls(tiny_config(arch, **config_kwargs)).eval()
    if logit_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(logit_scale)
    return model


def truncated_draft(
    target: torch.nn.Module, layers: int = 1, noise: float = 0.0, seed: int = 1
) -> torch.nn.Module:
    """A draft sharing the target's embeddings and first ``layers`` layers, so it agrees often."""
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    if hasattr(config, "layer_types") and config.layer_types is not None:
        config.layer_types = config.layer_types[:layers]
    draft = type(target)(config).eval()
    state = {k: v for k, v in target.state_dict().items() if k in draft.state_dict()}
    draft.load_state_dict(state)
    draft.to(next(target.parameters()).device)  # beside the target (a CUDA target gets a CUDA draft)
    if noise > 0:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in draft.parameters():
                p.add_((noise * torch.randn(p.shape, generator=gen)).to(p.device) * p.std())
    return draft


def prompts(batch: int, length: int, vocab_size: int = 128, seed: int = 0, pad_rows: dict | None = None):
    """``input_ids, attention_mask`` with left padding: ``pad_rows = {row: pad_count}``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    for row, count in (pad_rows or {}).items():
        mask[row, :count] = 0
        ids[row, :count] = PAD
    return ids, mask


def reference_greedy(model, ids, mask, max_new_tokens, eos_token_id=None):
    """The target's own ``generate(do_sample=False)``: the oracle of every greedy test."""
    with torch.no_grad():
        return model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=PAD,
        )


# Families that mix attention layer kinds and add softcapping, sinks or their own scaling. Each tiny
# config makes its variants matter: a window shorter than the tests' prompts and generations,
# attention sharpened (``attn_scale`` on q_proj and k_proj) so softcap, window and sinks change the tokens.
WINDOW = 4
_FAMILY_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
    tie_word_embeddings=False,
    sliding_window=WINDOW,
)
_SLIDING, _FULL = "sliding_attention", "full_attention"


def _families():
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        GptOssConfig,
        GptOssForCausalLM,
        Llama4ForCausalLM,
        Llama4TextConfig,
    )

    return {
        # alternating sliding / full, attention-logit and final-logit softcapping, query_pre_attn_scalar != head_dim
        "gemma2": (
            Gemma2Config,
            Gemma2ForCausalLM,
            dict(
                num_hidden_layers=2,
                layer_types=[_SLIDING, _FULL],
                query_pre_attn_scalar=24,
                attn_logit_softcapping=1.0,
                final_logit_softcapping=2.0,
            ),
        ),
        # sliding layers around a full one (the draft's first two layers mix kinds too), per-kind RoPE
        "gemma3": (
            Gemma3TextConfig,
            Gemma3ForCausalLM,
            dict(num_hidden_layers=3, layer_types=[_SLIDING, _FULL, _SLIDING], query_pre_attn_scalar=24),
        ),
        # alternating sliding / full, learned per-head sinks, a few experts, YaRN RoPE
        "gpt_oss": (
            GptOssConfig,
            GptOssForCausalLM,
            dict(
                num_hidden_layers=2,
                layer_types=[_SLIDING, _FULL],
                num_local_experts=4,
                num_experts_per_tok=2,
                rope_parameters=dict(
                    rope_type="yarn",
                    rope_theta=10000.0,
                    factor=4.0,
                    beta_fast=32.0,
                    beta_slow=1.0,
                    truncate=False,
                    original_max_position_embeddings=64,
                ),
            ),
        ),
        # chunked attention (chunks of WINDOW positions) then a full NoPE layer, mixture of experts
        "llama4": (
            Llama4TextConfig,
            Llama4ForCausalLM,
            dict(
                num_hidden_layers=2,
                layer_types=["chunked_attention", _FULL],
                attention_chunk_size=WINDOW,
                no_rope_layers=[1, 0],
                use_qk_norm=False,
                intermediate_size_mlp=128,
                num_local_experts=2,
                num_experts_per_tok=1,
            ),
        ),
    }


FAMILIES = ("gemma2", "gemma3", "gpt_oss", "llama4")


def tiny_family_config(family: str, **overrides):
    config_cls, _, kwargs = _families()[family]
    return config_cls(**{**_FAMILY_COMMON, **kwargs, **overrides})


def tiny_family_target(
    family: str, seed: int = 0, logit_scale: float = 1.0, attn_scale: float = 4.0, **overrides
) -> torch.nn.Module:
    """A random target of ``family`` (see :data:`FAMILIES`); ``attn_scale`` sharpens its attention and
    GPT-OSS's sinks are drawn large enough to take a visible share of the softmax. A softcapped family
    attends with transformers' eager attention, the one that applies the softcap (some releases default
    Gemma 2 to SDPA, which ignores it: ``tests/capture/test_layer_kinds.py`` covers that case)."""
    _, model_cls, _ = _families()[family]
    torch.manual_seed(seed)
    config = tiny_family_config(family, **overrides)
    if getattr(config, "attn_logit_softcapping", None):
        config._attn_implementation = "eager"
    model = model_cls(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(attn_scale)
            layer.self_attn.k_proj.weight.mul_(attn_scale)
            for norm in (getattr(layer.self_attn, "q_norm", None), getattr(layer.self_attn, "k_norm", None)):
                if norm is not None:  # Gemma 3's q/k norms undo the scaling: scale by (1 + w) instead
                    norm.weight.add_(attn_scale - 1.0)
            if hasattr(layer.self_attn, "sinks"):
                layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape))
        if logit_scale != 1.0:
            model.lm_head.weight.mul_(logit_scale)
    return model


def family_draft(target: torch.nn.Module) -> torch.nn.Module:
    """The family's truncated draft: its first two layers for Gemma 3 (they mix kinds), one otherwise."""
    return truncated_draft(target, layers=2 if target.config.num_hidden_layers > 2 else 1)


SHARP_VOCAB = 16  # the vocabulary of :func:`sharp_sd_pair`'s models: small enough to count every outcome


@functools.cache
def sharp_sd_pair(k: int):
    """``(target, draft, program)``: a target of ``SHARP_VOCAB`` tokens with sharp distributions, a noisy truncated
    draft of it, and the pair compiled eager in mode ``sd`` at ``k`` (never run as AR): what the sampling checks
    count outcomes over."""
    import saguaro

    target = tiny_target("llama", vocab_size=SHARP_VOCAB, logit_scale=12.0, seed=5)
    draft = truncated_draft(target, noise=0.8)
    program = saguaro.compile(target, draft, k=k, mode="sd", backend="eager", sd_when_faster=False)
    return target, draft, program
