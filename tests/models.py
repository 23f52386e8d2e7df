"""Tiny random Hugging Face models built from configs (tests never download)."""

from __future__ import annotations

import copy

import torch
from transformers import (
    LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
    Qwen3ForCausalLM,
)

ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}

PAD, BOS, EOS = 0, 1, 2


def tiny_config(arch: str, vocab_size: int = 128, layers: int = 2, hidden: int = 64, max_positions: int = 256):
    config_cls, _ = ARCHITECTURES[arch]
    kwargs = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, tie_word_embeddings=False,
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


def truncated_draft(target: torch.nn.Module, layers: int = 1, noise: float = 0.0, seed: int = 1) -> torch.nn.Module:
    """A draft sharing the target's embeddings and first ``layers`` layers, so it agrees often."""
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    if hasattr(config, "layer_types") and config.layer_types is not None:
        config.layer_types = config.layer_types[:layers]
    draft = type(target)(config).eval()
    state = {k: v for k, v in target.state_dict().items() if k in draft.state_dict()}
    draft.load_state_dict(state)
    if noise > 0:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in draft.parameters():
                p.add_(noise * torch.randn(p.shape, generator=gen) * p.std())
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
        return model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                              eos_token_id=eos_token_id, pad_token_id=PAD)
