"""Verification and sampling math: plain tensor functions, shared by the runtime and the passes.

Exactness rules (DESIGN.md §1):
* temperature 0: accept the longest prefix of draft tokens equal to the target's argmax; the next
  token is the target's argmax after it.
* temperature > 0: accept ``x_i`` with probability ``min(1, p(x_i) / q(x_i))`` where ``q`` is the
  distribution the proposal was actually drawn from (one-hot for a deterministic proposal); at the
  first rejection resample from ``norm(max(0, p - q))``; on full acceptance sample a bonus from ``p``.
"""

from __future__ import annotations

import torch


def probabilities(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``softmax(logits / temperature)`` in float32; ``logits [..., V]`` → ``[..., V]``."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample_tokens(
    logits: torch.Tensor,  # [B, V]
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Greedy argmax at temperature 0, else a draw from ``softmax(logits / T)``.

    Returns ``tokens [B]`` and the distribution sampled from ``[B, V]`` (``None`` when greedy).
    """
    if temperature == 0.0:
        return logits.argmax(dim=-1), None
    probs = probabilities(logits, temperature)  # [B, V]
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1), probs


def one_hot_proposal(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The proposal distribution of deterministic tokens ``[B, K]``: ``δ_x`` as ``[B, K, V]``."""
    return torch.nn.functional.one_hot(tokens, vocab_size).float()


def verify_speculation(
    target_logits: torch.Tensor,  # [B, K+1, V]: row i is the target's distribution after x_i (x_0 = r)
    draft_tokens: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor | None,  # [B, K, V]: what x_i was drawn from; unused when greedy
    temperature: float,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``accepted [B]`` (in ``0..K``) and ``next_token [B]`` (recovery or bonus)."""
    B, K = draft_tokens.shape
    if temperature == 0.0:
        choice = target_logits.argmax(dim=-1)  # [B, K+1]
        matches = (choice[:, :K] == draft_tokens).long()  # [B, K]
        accepted = matches.cumprod(dim=1).sum(dim=1)  # [B]
        return accepted, choice.gather(1, accepted[:, None]).squeeze(1)
    if draft_probs is None:
        raise ValueError("draft_probs is required at temperature > 0: verification needs the proposal distribution")
    p = probabilities(target_logits, temperature)  # [B, K+1, V]
    q = draft_probs.float()
    p_x = p[:, :K].gather(2, draft_tokens[:, :, None]).squeeze(2)  # [B, K]
    q_x = q.gather(2, draft_tokens[:, :, None]).squeeze(2)  # [B, K]
    u = torch.rand(B, K, generator=generator, device=p.device)  # [B, K]
    accept = (u * q_x < p_x).long()  # u < p/q without dividing by q
    accepted = accept.cumprod(dim=1).sum(dim=1)  # [B]
    q_ext = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)  # [B, K+1, V]; row K: bonus, residual = p
    row = accepted[:, None, None].expand(B, 1, p.shape[-1])
    p_row = p.gather(1, row).squeeze(1)  # [B, V]
    residual = (p_row - q_ext.gather(1, row).squeeze(1)).clamp_min(0.0)  # [B, V]
    mass = residual.sum(dim=-1, keepdim=True)  # [B, 1]
    # p == q on a rejected row has probability zero; keep sampling well defined anyway
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_row)
    next_token = torch.multinomial(residual, 1, generator=generator).squeeze(1)
    return accepted, next_token
