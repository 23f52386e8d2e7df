"""Fan-out allocation and the online estimates of ``α`` and ``ρ`` it uses (docs/design.md, "Geometric
fan-out"): ``F_j ∝ P(j)^(1/(1+ρ))`` under ``Σ F_j = MQ``, capped and rounded to keep the budget."""

from __future__ import annotations

import math

import torch

RANK_BINS = 64


def outcome_probabilities(alpha: float, k: int) -> list[float]:
    """``P(j)`` for ``j = 0..k`` under per-token acceptance rate ``alpha``."""
    alpha = min(max(alpha, 1e-4), 1 - 1e-4)
    return [alpha**j * (1 - alpha) for j in range(k)] + [alpha**k]


def geometric_fan_out(alpha: float, rho: float, k: int, budget: int, cap: int | None = None) -> list[int]:
    """Integer fan-outs ``F_0..F_k`` summing to ``budget``, each in ``[1, cap]`` while the budget allows
    (``budget >= k+1``), ``∝ P(j)^(1/(1+ρ))``; ``ValueError`` past ``(k+1)·cap``."""
    cap = cap if cap is not None else max(1, budget)
    n = k + 1
    floor = 1 if budget >= n else 0
    if budget > n * cap:
        raise ValueError(f"fan_out_budget={budget} exceeds {n} positions x cap {cap}")
    weights = [p ** (1.0 / (1.0 + max(rho, 1e-3))) for p in outcome_probabilities(alpha, k)]
    fan = [floor] * n
    remaining = budget - floor * n
    # water-filling: hand out the remaining branches proportionally, respecting the cap
    free = [j for j in range(n) if fan[j] < cap]
    while remaining > 0 and free:
        total = sum(weights[j] for j in free)
        shares = {j: remaining * weights[j] / total for j in free}
        granted = 0
        for j in free:
            add = min(int(math.floor(shares[j])), cap - fan[j])
            fan[j] += add
            granted += add
        remaining -= granted
        if granted == 0:  # largest remainders, ties to the lower position
            order = sorted(free, key=lambda j: (-(shares[j] - math.floor(shares[j])), -weights[j], j))
            for j in order[:remaining]:
                fan[j] += 1
            remaining = budget - sum(fan)
        free = [j for j in range(n) if fan[j] < cap]
    return fan


class OutcomeEstimator:
    """Online ``α``, the maximum-likelihood estimate of a geometric truncated at ``K``, and ``ρ``, the slope
    of ``−log miss(F)`` on ``log F`` (``F`` misses exactly when the outcome token ``r'`` ranks ``≥ F``)."""

    def __init__(self, k: int, alpha_prior: float = 0.7, rho_prior: float = 1.0, prior_weight: float = 4.0):
        self.k = k
        self.accepted = alpha_prior * prior_weight
        self.rejected = (1 - alpha_prior) * prior_weight
        self.rho_prior = rho_prior
        # host statistics: CPU tensors (the server hands this class host lists, never device tensors)
        self.rank_counts = torch.zeros(
            RANK_BINS + 1, dtype=torch.float64, device="cpu"
        )  # last bin: rank >= RANK_BINS
        self.rank_counts_at = torch.zeros(
            k + 1, RANK_BINS + 1, dtype=torch.float64, device="cpu"
        )  # [K+1, bins]
        self._ranks_seen = 0
        self._fitted_at, self._fitted = -1.0, None

    def observe(self, accepted, ranks=None) -> None:
        """Record ``accepted [N]`` in ``0..K`` and, when given, the ranks of ``r'`` ``[N]`` (0 = top)."""
        accepted = torch.as_tensor(accepted, dtype=torch.long, device="cpu")
        self.accepted += float(accepted.sum())
        self.rejected += float((accepted < self.k).sum())
        if ranks is not None:
            self.observe_ranks(accepted, ranks)

    def observe_ranks(self, accepted, ranks) -> None:
        """Record the ranks of ``r'`` ``[N]`` for outcomes at ``accepted [N]`` observed earlier."""
        bins = torch.as_tensor(ranks, dtype=torch.long, device="cpu").clamp(0, RANK_BINS)
        if not bins.numel():
            return
        accepted = torch.as_tensor(accepted, dtype=torch.long, device="cpu")
        self.rank_counts += torch.bincount(bins, minlength=RANK_BINS + 1)
        self._ranks_seen += bins.numel()
        if accepted.numel() == bins.numel():
            self.rank_counts_at.index_put_(
                (accepted, bins), torch.ones_like(bins, dtype=torch.float64), accumulate=True
            )

    @property
    def alpha(self) -> float:
        return self.accepted / max(self.accepted + self.rejected, 1e-9)

    def miss_curve(self) -> torch.Tensor:
        """``miss(F) = P(rank >= F)`` for ``F = 1..RANK_BINS``."""
        total = self.rank_counts.sum()
        if total == 0:
            return torch.zeros(0, dtype=torch.float64, device="cpu")
        tail = self.rank_counts.flip(0).cumsum(0).flip(0) / total  # tail[i] = P(rank >= i)
        return tail[1 : RANK_BINS + 1]

    def miss_function(self):
        """``miss(j, F) = (F + 1)^(−ρ_j)``, ``ρ_j`` fitted to the ranks seen at position ``j`` (to all
        positions below :data:`MIN_RANKS` ranks, the prior before any), refitted every :data:`REFIT_EVERY`
        observations. Convex and decreasing in ``F``: the planner's greedy allocation is optimal under it."""
        total = float(self._ranks_seen)
        if self._fitted is None or total - self._fitted_at >= REFIT_EVERY:
            overall = _planning_miss_fit(self.rank_counts, self.rho_prior)
            self._fitted = [_planning_miss_fit(counts, overall) for counts in self.rank_counts_at]
            self._fitted_at = total
        rhos = self._fitted
        return lambda j, f: (f + 1.0) ** (-rhos[j])

    @property
    def rho(self) -> float:
        miss = self.miss_curve()
        if miss.numel() == 0 or self.rank_counts.sum() < 16:
            return self.rho_prior
        f = torch.arange(1, miss.numel() + 1, dtype=torch.float64, device="cpu")
        keep = miss > 0
        if int(keep.sum()) < 2:
            return self.rho_prior
        x, y = torch.log(f[keep]), torch.log(miss[keep])
        x_c = x - x.mean()
        slope = float((x_c * (y - y.mean())).sum() / (x_c * x_c).sum().clamp_min(1e-12))
        return min(max(-slope, 0.05), 10.0)


MIN_RANKS = 16  # observed ranks before a miss curve is fitted (the prior before)
REFIT_EVERY = 8  # observations between two fits of the planning miss curves


def _planning_miss_fit(counts: torch.Tensor, prior: float) -> float:
    """``ρ'`` of ``miss(F) = (F + 1)^(−ρ')`` fitted to rank counts ``[RANK_BINS + 1]``."""
    total = counts.sum()
    if total < MIN_RANKS:
        return prior
    miss = (counts.flip(0).cumsum(0).flip(0) / total)[1 : RANK_BINS + 1]  # P(rank >= F), F = 1..
    x = torch.log(torch.arange(2, miss.numel() + 2, dtype=torch.float64, device="cpu"))  # log(F + 1)
    keep = miss > 0
    if not bool(keep.any()):
        return 10.0
    y = torch.log(miss[keep])
    return float(min(max(-(x[keep] * y).sum() / (x[keep] * x[keep]).sum(), 0.05), 10.0))


def resolve_fan_out(fan_out, k: int, budget: int, estimator: OutcomeEstimator | None, cap: int) -> list[int]:
    """This round's fan-out list from the configured ``fan_out`` (an int, a list, or "geometric")."""
    if fan_out == "geometric":
        alpha = estimator.alpha if estimator is not None else 0.7
        rho = estimator.rho if estimator is not None else 1.0
        return geometric_fan_out(alpha, rho, k, min(budget, (k + 1) * cap), cap)
    if isinstance(fan_out, int):
        return [min(fan_out, cap)] * (k + 1)
    return [min(int(f), cap) for f in fan_out]
