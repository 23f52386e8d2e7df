"""Validation of ``generate`` arguments: clear errors naming the value and what is allowed."""

from __future__ import annotations

import math

import torch

from saguaro.core.config import MODES
from saguaro.core.errors import ConfigError


def checked_prompt(input_ids, attention_mask, device):
    """``(input_ids [B, T], attention_mask [B, T])`` long on ``device``, a ``[T]`` prompt made ``[1, T]``,
    no mask all ones; ``ValueError`` for an empty or non-integer tensor, a rank other than 1 or 2, a mask
    of another shape, an all-padding row, right padding (token ids are not checked here)."""
    if not isinstance(input_ids, torch.Tensor):
        raise ValueError(f"input_ids must be a LongTensor [B, T], got {type(input_ids).__name__}")
    if input_ids.dim() == 1:
        input_ids = input_ids[None, :]
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape [B, T], got {tuple(input_ids.shape)}")
    if input_ids.numel() == 0:
        raise ValueError(
            f"input_ids is empty (shape {tuple(input_ids.shape)}): give at least one prompt token"
        )
    if input_ids.dtype not in (torch.long, torch.int32, torch.int64):
        raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} must equal input_ids shape {tuple(input_ids.shape)}"
        )
    attention_mask = attention_mask.to(device=device, dtype=torch.long)
    real = attention_mask.sum(dim=1)
    if bool((real == 0).any()):
        raise ValueError(f"prompt rows {(real == 0).nonzero().flatten().tolist()} are empty (all padding)")
    # left padding only: once a row's mask turns 1 it stays 1
    if bool((attention_mask[:, 1:] < attention_mask[:, :-1]).any()):
        raise ValueError(
            "attention_mask must describe left padding (0s then 1s in each row); right padding is not allowed"
        )
    return input_ids.to(device=device, dtype=torch.long), attention_mask


def check_generate_args(input_ids, attention_mask, max_new_tokens, temperature, seed, eos_token_id, device):
    """Return ``(input_ids, attention_mask, eos_ids)`` on ``device``, or raise ``ValueError``."""
    input_ids, attention_mask = checked_prompt(input_ids, attention_mask, device)
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
    return input_ids, attention_mask, eos_ids


def validate_call(program, input_ids, max_new_tokens, temperature, eos_token_id, seed, attention_mask, mode):
    """``(mode, input_ids [B, T], attention_mask [B, T], eos ids)`` of a ``generate`` call on the target's
    device; ``ValueError`` or ``ConfigError`` naming the value at fault."""
    mode = mode or program.config.mode
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is not allowed: choose one of {', '.join(MODES)}")
    if mode != "ar" and program.draft is None and (mode != "ssd" or program.lanes is None):
        if program.lanes is not None:
            raise ConfigError(
                f"mode={mode!r} needs a local draft: this program's draft is the server at "
                f"{program.config.draft_address} (draft=None); use mode='ssd' (exact AR when the "
                "server cannot serve) or 'ar', or compile with draft=... as well"
            )
        raise ValueError(f"mode={mode!r} needs a draft model; compile with draft=... or use mode='ar'")
    if eos_token_id == "default":
        eos_token_id = program.eos_token_id
    input_ids, attention_mask, eos_ids = check_generate_args(
        input_ids, attention_mask, max_new_tokens, temperature, seed, eos_token_id, program.target.spec.device
    )
    vocab = program.target.spec.vocab_size
    if bool(((input_ids < 0) | (input_ids >= vocab)).any()):
        raise ValueError(f"input_ids hold token ids outside the vocabulary [0, {vocab})")
    T = input_ids.shape[1]
    if T + max_new_tokens > program.max_length:
        raise ValueError(
            f"prompt length {T} + max_new_tokens {max_new_tokens} = {T + max_new_tokens} exceeds the maximum "
            f"of {program.max_length} tokens (KV capacity / the models' max_position_embeddings)"
        )
    return mode, input_ids, attention_mask, eos_ids


def checked_controls(controls, vocab_size: int):
    """``controls`` (None, a ``SamplingControls`` or a dict of its fields) checked, None where they change
    nothing; ``ValueError`` for a field out of range or a token outside the vocabulary, ``TypeError`` else."""
    from saguaro.tensor_math.logits_processing import FIELDS as allowed
    from saguaro.tensor_math.logits_processing import SamplingControls

    if controls is None:
        return None
    if isinstance(controls, dict):
        unknown = sorted(set(controls) - set(allowed))
        if unknown:
            raise TypeError(f"controls {unknown} are not sampling controls; allowed: {', '.join(allowed)}")
        controls = SamplingControls.of(**controls)
    if not isinstance(controls, SamplingControls):
        raise TypeError(
            f"controls={controls!r} is not allowed: give a SamplingControls, a dict of its fields, or None"
        )
    controls.check(vocab_size)
    return controls if controls.active else None
