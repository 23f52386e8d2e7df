"""Scoring (``Program.score``): the target's log-probabilities of a sequence's own tokens, in one call.

One ``target.score`` stage call over a fresh store, then the float32 log-softmax of its logits: the target's
raw distribution in every mode, as ``torch.log_softmax(model(ids).logits.float(), -1)`` gives it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from saguaro.core.errors import ConfigError
from saguaro.core.stages import TARGET_SCORE
from saguaro.runtime.base.inputs import checked_prompt


@dataclass
class ScoreOutput:
    """What :func:`score` returns, on the target's device; NaN (ids: -1) at each row's first real token
    and on its left padding."""

    token_logprobs: torch.Tensor  # [B, T] float32: log p(input_ids[b, t] | input_ids[b, :t])
    top_ids: torch.Tensor  # [B, T, top] long: the top likeliest tokens at t, the likeliest first
    top_logprobs: torch.Tensor  # [B, T, top] float32: their log-probabilities


def score(program, input_ids, attention_mask=None, top: int = 0) -> ScoreOutput:
    """Score ``input_ids [B, T]`` (or ``[T]``, left-padded per ``attention_mask``) with the target.

    The caller holds the program's lock under ``torch.inference_mode()``. ``ValueError`` for input
    ``generate`` refuses too and for ``top`` outside ``0..V``; ``ConfigError`` where the target's builder
    lacks the stage (a loaded artifact)."""
    target = program.target
    if not target.provides(TARGET_SCORE):
        raise ConfigError(
            f"this program cannot score tokens: its target has no {TARGET_SCORE.qualified} stage (a "
            "program loaded from an artifact holds only the stages it exported); logprobs need a "
            "program made by saguaro.compile"
        )
    vocab = target.spec.vocab_size
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= vocab:
        raise ValueError(f"top={top!r} is not allowed: it must be an int 0..{vocab} (the vocabulary size)")
    ids, mask = checked_prompt(input_ids, attention_mask, target.spec.device)
    if bool(((ids < 0) | (ids >= vocab)).any()):
        raise ValueError(f"input_ids hold token ids outside the vocabulary [0, {vocab})")
    B, T = ids.shape
    if T > program.max_length:
        raise ValueError(
            f"input_ids hold {T} tokens; this program scores at most {program.max_length} "
            "(KV capacity / the models' max_position_embeddings)"
        )
    padded_ids, padded_mask = program.shapes.pad_prompt(ids, mask, program.pad_token_id)  # into a bucket
    P = padded_ids.shape[1]
    index = torch.arange(P, device=ids.device).expand(B, P)  # [B, P]: a token's slot is its index
    padding = (padded_mask == 0).sum(dim=1)  # [B]
    positions = (index - padding[:, None]).clamp_min(-1)  # [B, P]: -1 on padding, masked once written
    store = target.new_store(B, program.shapes.capacity(P))
    (logits,) = target.run(TARGET_SCORE, store, padded_ids, positions, index)  # [B, P, V]
    # [B, T, V], the bucket's columns dropped
    logprobs = torch.log_softmax(logits[:, P - T :].float(), dim=-1)
    before = logprobs[:, :-1]  # [B, T-1, V]: the distribution of the token at t = 1..T-1
    real = mask.bool()
    scored = torch.zeros_like(real)  # [B, T]: a real token with a real token before it
    scored[:, 1:] = real[:, 1:] & real[:, :-1]
    token_logprobs = torch.full((B, T), float("nan"), dtype=torch.float32, device=ids.device)  # [B, T]
    token_logprobs[:, 1:] = before.gather(-1, ids[:, 1:, None]).squeeze(-1)
    token_logprobs.masked_fill_(~scored, float("nan"))
    top_ids = torch.full((B, T, top), -1, dtype=torch.long, device=ids.device)  # [B, T, top]
    top_logprobs = torch.full((B, T, top), float("nan"), dtype=torch.float32, device=ids.device)
    if top and T > 1:
        values, best = before.topk(top, dim=-1)  # [B, T-1, top], the most likely first
        top_logprobs[:, 1:], top_ids[:, 1:] = values, best
        top_logprobs.masked_fill_(~scored[..., None], float("nan"))
        top_ids.masked_fill_(~scored[..., None], -1)
    return ScoreOutput(token_logprobs, top_ids, top_logprobs)
