"""Validation of ``generate`` arguments: clear errors naming the value and what is allowed."""

from __future__ import annotations

import math

import torch


def check_generate_args(input_ids, attention_mask, max_new_tokens, temperature, seed, eos_token_id, device):
    """Return ``(input_ids, attention_mask, eos_ids)`` on ``device``, or raise ``ValueError``."""
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"input_ids must be a LongTensor [B, T], got {type(input_ids).__name__}")
    if input_ids.dim() == 1:
        input_ids = input_ids[None, :]
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape [B, T], got {tuple(input_ids.shape)}")
    if input_ids.numel() == 0:
        raise ValueError(f"input_ids is empty (shape {tuple(input_ids.shape)}): give at least one prompt token")
    if input_ids.dtype not in (torch.long, torch.int32, torch.int64):
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape {tuple(input_ids.shape)}")
    attention_mask = attention_mask.to(device=device, dtype=torch.long)
    real = attention_mask.sum(dim=1)
    if bool((real == 0).any()):
        raise ValueError(f"prompt rows {(real == 0).nonzero().flatten().tolist()} are empty (all padding)")
    # left padding only: once a row's mask turns 1 it stays 1
    if bool((attention_mask[:, 1:] < attention_mask[:, :-1]).any()):
        raise ValueError("attention_mask must describe left padding (0s then 1s in each row); right padding "
                         "is not allowed")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} is not allowed: it must be an int >= 1")
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature={temperature!r} is not allowed: it must be a finite number >= 0")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ValueError(f"seed={seed!r} is not allowed: it must be an int or None")
    if eos_token_id is None:
        eos_ids = []
    elif isinstance(eos_token_id, int):
        eos_ids = [eos_token_id]
    else:
        eos_ids = [int(e) for e in eos_token_id]
    return input_ids.to(device=device, dtype=torch.long), attention_mask, eos_ids
