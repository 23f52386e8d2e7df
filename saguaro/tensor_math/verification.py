"""Verification and sampling math for the runtime and the passes (rules: docs/design.md, Losslessness)."""

from __future__ import annotations

import torch


def probabilities(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``softmax(logits / temperature)`` in float32; ``logits [..., V]`` → ``[..., V]``."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample_tokens(
    logits: torch.Tensor,  # [B, V]
    temperature: float,
    generator,  # a torch.Generator, None, or a list of one generator per row
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``tokens [B]`` (argmax at temperature 0, else :func:`draw`) and the ``[B, V]`` drawn from, or None."""
    if temperature == 0.0:
        return logits.argmax(dim=-1), None
    probs = probabilities(logits, temperature)  # [B, V]
    return draw(probs, generator), probs


def draw(probs: torch.Tensor, generator) -> torch.Tensor:
    """A token ``[B]`` per row of ``probs [B, V]`` by multinomial (a list: row b from ``generator[b]``)."""
    if isinstance(generator, (list, tuple)):
        drawn = [torch.multinomial(probs[b : b + 1], 1, generator=g) for b, g in enumerate(generator)]
        return torch.cat(drawn).squeeze(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def uniforms(shape: tuple, generator, device) -> torch.Tensor:
    """``torch.rand(shape)`` from ``generator`` (a list of one per row: row ``b`` as ``generator[b]`` draws it
    in a batch of its own; another count is a ``ValueError``)."""
    if isinstance(generator, (list, tuple)):
        if len(generator) != shape[0]:
            raise ValueError(f"{len(generator)} generators for {shape[0]} rows: give one generator per row")
        return torch.cat([torch.rand(1, *shape[1:], generator=g, device=device) for g in generator])
    return torch.rand(shape, generator=generator, device=device)


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The first index of ``probs [..., V]`` whose CDF exceeds ``u · total``, ``u [...]`` in [0, 1); p > 0."""
    cdf = probs.cumsum(dim=-1)  # [..., V]
    threshold = u[..., None] * cdf[..., -1:]
    return (cdf <= threshold).sum(dim=-1).clamp_max(probs.shape[-1] - 1)


def one_hot_proposal(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The proposal distribution of deterministic tokens ``[B, K]``: ``δ_x`` as ``[B, K, V]``."""
    return torch.nn.functional.one_hot(tokens, vocab_size).float()


def verify_greedy(
    target_logits: torch.Tensor,  # [B, K+1, V]: row i is the target's distribution after x_i (x_0 = r)
    draft_tokens: torch.Tensor,  # [B, K]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: ``accepted [B]`` in ``0..K`` and ``next_token [B]`` (recovery or bonus)."""
    return verify_choice(target_logits.argmax(dim=-1), draft_tokens)


def verify_choice(choice: torch.Tensor, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification against the target's ``choice [B, K+1]`` (its argmax, processed or not)."""
    K = draft_tokens.shape[1]
    matches = (choice[:, :K] == draft_tokens).long()  # [B, K]
    accepted = matches.cumprod(dim=1).sum(dim=1)  # [B]
    return accepted, choice.gather(1, accepted[:, None]).squeeze(1)


def verify_sampled(
    target_logits: torch.Tensor,  # [B, K+1, V]
    draft_tokens: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor,  # [B, K, V]: what x_i was drawn from (one-hot for a fixed proposal)
    inv_temperature: torch.Tensor,  # [] float
    accept_u: torch.Tensor,  # [B, K] uniforms of the ratio tests
    resample_u: torch.Tensor,  # [B] uniform of the residual (or bonus) draw
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled verification with explicit uniforms, so it can live inside a graph."""
    p = torch.softmax(target_logits.float() * inv_temperature, dim=-1)  # [B, K+1, V]
    return verify_probabilities(p, draft_tokens, draft_probs, accept_u, resample_u)


def verify_probabilities(
    p: torch.Tensor,  # [B, K+1, V]: the target's distribution at each position (processed or not)
    draft_tokens: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor,  # [B, K, V]
    accept_u: torch.Tensor,  # [B, K]
    resample_u: torch.Tensor,  # [B]
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`verify_sampled`'s rule over the target's distributions ``p``: ``accepted``, ``next_token``."""
    K = draft_tokens.shape[1]
    q = draft_probs.float()
    p_x = p[:, :K].gather(2, draft_tokens[:, :, None]).squeeze(2)  # [B, K]
    q_x = q.gather(2, draft_tokens[:, :, None]).squeeze(2)  # [B, K]
    accept = (accept_u * q_x < p_x).long()  # u < p/q without dividing by q
    accepted = accept.cumprod(dim=1).sum(dim=1)  # [B]
    q_ext = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)  # [B, K+1, V]; row K: bonus, residual = p
    row = accepted[:, None, None].expand(-1, 1, p.shape[-1])
    p_row = p.gather(1, row).squeeze(1)  # [B, V]
    residual = (p_row - q_ext.gather(1, row).squeeze(1)).clamp_min(0.0)  # [B, V]
    mass = residual.sum(dim=-1, keepdim=True)  # [B, 1]
    # p == q on a rejected row has probability zero; keep sampling well defined anyway
    residual = torch.where(mass > 0, residual, p_row)
    return accepted, sample_inverse_cdf(residual, resample_u)


def outcome_tokens(
    draft_tokens: torch.Tensor, accepted: torch.Tensor, next_token: torch.Tensor
) -> torch.Tensor:
    """A round's decided tokens ``[B, K+1]``: ``x_1..x_a``, ``r'`` at ``a``, filler after; traceable by
    ``torch.fx`` (no size read as a number: ``verify_round`` splices it)."""
    padded = torch.cat([draft_tokens, draft_tokens[:, :1]], dim=1)  # [B, K+1]
    slots = torch.ones_like(padded[:1]).cumsum(dim=1) - 1  # [1, K+1]: 0 .. K
    return torch.where(slots == accepted[:, None], next_token[:, None], padded)


def verification_uniforms(batch: int, k: int, generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The uniforms one sampled verification consumes: ``accept_u [B, K]`` and ``resample_u [B]``."""
    u = uniforms((batch, k + 1), generator, device)  # [B, K+1]
    return u[:, :k], u[:, k]


def verify_speculation(
    target_logits: torch.Tensor,  # [B, K+1, V]
    draft_tokens: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor | None,  # [B, K, V]; unused when greedy
    temperature: float,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager verification (the oracle of the fused ``target.verify`` stages)."""
    if temperature == 0.0:
        return verify_greedy(target_logits, draft_tokens)
    if draft_probs is None:
        raise ValueError(
            "draft_probs is required at temperature > 0: verification needs the proposal distribution"
        )
    B, K = draft_tokens.shape
    accept_u, resample_u = verification_uniforms(B, K, generator, target_logits.device)
    inv_t = torch.full((), 1.0 / temperature, device=target_logits.device)
    return verify_sampled(target_logits, draft_tokens, draft_probs, inv_t, accept_u, resample_u)
