"""Sampling controls in the rounds (``generate(..., controls=SamplingControls(...))``): where they change what the
target decides, every token is decided from the processed distribution of
:mod:`saguaro.tensor_math.logits_processing`.

- The prefill's first token and AR's steps: the step's logits processed, then the argmax (temperature 0) or a
  draw (the same generator calls as without controls: ``torch.multinomial`` over the row's distribution).
- SD's and SSD's verification (every speculation: SD's draft, SSD's hits and both fallbacks): the target's
  logits over ``[r, x_1..x_k]`` leave the graph (:data:`TARGET_VERIFY_LOGITS`), each position is processed with the
  sequence so far including the draft tokens before it on the path, and the acceptance test and the residual run on
  that processed ``p`` against the ``q`` the proposal was drawn from (the draft's own distribution: any ``q`` keeps
  the output exact, the closer to ``p`` the more is accepted). Greedy: the longest prefix equal to the processed
  argmax. The uniforms are those the fused stages draw (``verification_uniforms``).

Controls that leave greedy's argmax alone (``top_k``, ``top_p``, ``min_p``) change nothing at temperature 0: the
fused greedy stages run then.
"""

from __future__ import annotations

import torch

from saguaro.core.errors import ConfigError
from saguaro.core.stages import TARGET_VERIFY_LOGITS
from saguaro.runtime.base.model_runner import ModelRunner
from saguaro.runtime.base.state import DecodeState
from saguaro.tensor_math import logits_processing as lp
from saguaro.tensor_math import verification


def in_effect(state: DecodeState) -> lp.SamplingControls | None:
    """``state``'s controls where they change a decision at its temperature, else None."""
    controls = state.controls
    if controls is None or not controls.active:
        return None
    if state.temperature == 0 and not controls.changes_argmax:
        return None
    return controls


def histories(state: DecodeState, vocab_size: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(seen [B, V], output [B, V])``: counts of each row's tokens so far (prompt and output, the pending token
    included) and of its output's alone; ``(None, None)`` when the controls need no history."""
    if not state.controls.needs_history:
        return None, None
    seqs = state.seqs
    steps = torch.arange(seqs.tokens.shape[1], device=seqs.tokens.device)[None, :]  # [1, C]
    held = (steps >= seqs.padding[:, None]) & (steps < seqs.lengths[:, None])  # [B, C]
    seen = lp.token_counts(seqs.tokens, held, vocab_size)
    output = lp.token_counts(seqs.tokens, held & (steps >= seqs.prompt_len), vocab_size)
    return seen, output


def decide(logits: torch.Tensor, state: DecodeState) -> torch.Tensor:
    """The next token ``[B]`` of each row from the last position's ``logits [B, V]``: under ``state``'s controls
    where they are :func:`in_effect`, else as ``verification.sample_tokens`` decides (the same generator calls)."""
    controls = in_effect(state)
    if controls is None:
        return verification.sample_tokens(logits, state.temperature, state.generator)[0]
    seen, output = histories(state, logits.shape[-1])
    if state.temperature == 0:
        return lp.processed_choice(logits, controls, seen, output)
    probs = lp.processed_probabilities(logits, state.temperature, controls, seen, output)  # [B, V]
    return verification.draw(probs, state.generator)


def verify_controlled(target: ModelRunner, state: DecodeState, ids: torch.Tensor, positions: torch.Tensor,
                      index: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                      controls: lp.SamplingControls) -> tuple[torch.Tensor, torch.Tensor]:
    """A verify over ``ids [B, k+1]`` (``[r, x_1..x_k]``) under ``controls``: ``(accepted [B], next [B])``."""
    if not target.provides(TARGET_VERIFY_LOGITS):
        raise ConfigError("sampling controls need the target's verify_logits stage, which this loaded artifact does "
                          "not hold; compile the models with saguaro.compile, or generate with mode='ar'")
    (logits,) = target.run(TARGET_VERIFY_LOGITS, state.target_store, ids, positions, index)  # [B, k+1, V]
    seen, output = histories(state, logits.shape[-1])
    if seen is not None:
        seen, output = lp.path_counts(seen, draft_tokens), lp.path_counts(output, draft_tokens)  # [B, k+1, V]
    if state.temperature == 0:
        choice = lp.processed_choice(logits, controls, seen, output)  # [B, k+1]
        return verification.verify_choice(choice, draft_tokens)
    if draft_probs is None:
        raise ValueError("draft_probs is required at temperature > 0: verification needs the proposal distribution")
    p = lp.processed_probabilities(logits, state.temperature, controls, seen, output)  # [B, k+1, V]
    accept_u, resample_u = verification.verification_uniforms(state.seqs.batch, state.k, state.generator, ids.device)
    return verification.verify_probabilities(p, draft_tokens, draft_probs, accept_u, resample_u)
