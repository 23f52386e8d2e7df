"""Chi-square goodness of fit without scipy: statistic, degrees of freedom, p-value."""

from __future__ import annotations

import torch


def chi_square_pvalue(
    observed: torch.Tensor, expected_probs: torch.Tensor, min_expected: float = 5.0
) -> float:
    """P-value of ``observed`` counts against ``expected_probs`` (same shape, flattened).

    Cells whose expected count is below ``min_expected`` are pooled into one cell, the usual rule.
    """
    observed = observed.flatten().double()
    n = observed.sum()
    expected = expected_probs.flatten().double() / expected_probs.sum() * n
    small = expected < min_expected
    obs = torch.cat([observed[~small], observed[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2.0))
