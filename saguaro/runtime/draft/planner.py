"""The speculation planner: each SSD round's tree from measured costs and online estimates, maximising
expected tokens per second (docs/design.md, "The planner"); ``M = 0`` branches is an SD round."""

from __future__ import annotations

from dataclasses import dataclass, field

from saguaro.runtime.draft.fan_out import outcome_probabilities

EMA = 0.2  # weight of a new measurement in a running mean


@dataclass
class Plan:
    """One round's tree: ``budget`` branches ``M`` split as ``fan_out`` over the ``k+1`` positions."""

    budget: int
    fan_out: list
    hit_rate: float  # expected P_hit
    round_s: float  # expected seconds per round
    rate: float  # expected tokens per second (per row)


def best_fan_out(probabilities: list, miss, budget: int, cap: int) -> tuple[list, float]:
    """The fan-out of ``budget`` branches (each position at most ``cap``) maximising the hit rate
    ``Σ_j P(j)(1 − miss(j, F_j))``, and that rate; the greedy is optimal for convex decreasing ``miss``."""
    plans = fan_out_ladder(probabilities, miss, budget, cap)
    return plans[-1]


def fan_out_ladder(probabilities: list, miss, budget: int, cap: int) -> list[tuple[list, float]]:
    """``[(fan_out, hit_rate)]`` of the greedy allocation for every budget ``0..budget`` in one pass; it
    stops early once every position is capped."""
    fan = [0] * len(probabilities)
    hit = 0.0
    ladder = [(list(fan), hit)]
    for _ in range(budget):
        gains = [
            p * (miss(j, f) - miss(j, f + 1)) if f < cap else -1.0
            for j, (p, f) in enumerate(zip(probabilities, fan))
        ]
        j = max(range(len(fan)), key=lambda i: (gains[i], -i))
        if gains[j] < 0:
            break
        fan[j] += 1
        hit += gains[j]
        ladder.append((list(fan), hit))
    return ladder


@dataclass
class StageCosts:
    """Running means (seconds) of what the draft lane measured; ``frozen`` ones ignore new measurements."""

    glue_s: float | None = None
    step_s: float | None = None  # one draft step of the neural fallback
    tree_s: dict = field(default_factory=dict)  # branches M -> seconds per tree depth
    verify_s: dict = field(default_factory=dict)  # branches M -> the target's verify in such rounds

    @staticmethod
    def _mean(old, new):
        return new if old is None else (1 - EMA) * old + EMA * new

    def observe_build(self, budget: int, glue_s: float, depth_s: float | None) -> None:
        self.glue_s = self._mean(self.glue_s, glue_s)
        if depth_s is not None:
            self.tree_s[budget] = self._mean(self.tree_s.get(budget), depth_s)

    def observe_verify(self, budget: int, verify_s: float) -> None:
        self.verify_s[budget] = self._mean(self.verify_s.get(budget), verify_s)

    def observe_step(self, step_s: float) -> None:
        self.step_s = self._mean(self.step_s, step_s)

    def under_contention(self, contended: StageCosts | None) -> StageCosts:
        """Take the glue and tree depths ``contended`` measured while the target verified in place of those
        timed alone (a round's build runs against the verify); returns ``self``."""
        if contended is not None:
            self.glue_s = contended.glue_s if contended.glue_s is not None else self.glue_s
            self.tree_s |= contended.tree_s
        return self

    def tree(self, budget: int) -> float:
        return self.tree_s.get(budget, 0.0)  # optimistic while unmeasured: each candidate is tried once

    def verify(self, budget: int) -> float:
        if budget in self.verify_s:
            return self.verify_s[budget]
        return min(self.verify_s.values()) if self.verify_s else 0.0


class Planner:
    """Chooses each round's plan among ``budgets`` (branch counts; 0 is an SD round)."""

    def __init__(self, k: int, budgets: list[int], cap: int):
        self.k = k
        self.budgets = sorted(set(budgets) | {0})
        self.cap = cap
        self.costs = StageCosts()
        self.adaptive = True  # False: plan from the costs given, never from new measurements

    @property
    def measured(self) -> StageCosts:
        """Where new measurements go: the plan's costs if adaptive, else a scratch copy thrown away."""
        return self.costs if self.adaptive else StageCosts()

    def expected_round_s(self, budget: int, hit_rate: float, miss_s: float) -> float:
        c, k = self.costs, self.k
        build = (c.glue_s or 0.0) + (k * c.tree(budget) if budget else 0.0)
        return max(c.verify(budget), build) + (1.0 - hit_rate) * miss_s

    def plan(self, alpha: float, miss, fallback: str = "neural", fast_tokens: float = 1.0) -> Plan:
        """The plan with the most expected tokens per second under acceptance ``alpha``, ``miss(j, F)`` and
        the ``fallback`` a miss takes (``fast_tokens``: tokens a fast-fallback round decides)."""
        probabilities = outcome_probabilities(alpha, self.k)
        tokens = sum(p * (j + 1) for j, p in enumerate(probabilities))
        if fallback == "neural":
            miss_tokens, miss_s = tokens, self.k * (self.costs.step_s or 0.0)
        else:
            miss_tokens, miss_s = fast_tokens, 0.0
        ladder = fan_out_ladder(probabilities, miss, max(self.budgets), self.cap)
        best = None
        for budget in self.budgets:
            fan, hit = ladder[min(budget, len(ladder) - 1)]  # the ladder stops early when every F_j is capped
            round_s = self.expected_round_s(sum(fan), hit, miss_s)
            decided = hit * tokens + (1.0 - hit) * miss_tokens
            plan = Plan(sum(fan), fan, hit, round_s, decided / round_s if round_s > 0 else float("inf"))
            if best is None or plan.rate > best.rate:
                best = plan
        return best


PRIOR_ALPHA, PRIOR_RHO = 0.8, 1.5  # the outcomes assumed before a generation has seen any


def prior_plan(costs: StageCosts, k: int, cap: int) -> Plan:
    """SSD's best plan costed with ``costs`` under :data:`PRIOR_ALPHA` and :data:`PRIOR_RHO`."""
    planner = Planner(k, [0, *costs.tree_s], cap)
    planner.costs = costs
    return planner.plan(PRIOR_ALPHA, lambda j, f: (f + 1.0) ** (-PRIOR_RHO))


def prior_tokens(k: int) -> float:
    """Tokens a round decides per row under the prior acceptance :data:`PRIOR_ALPHA`."""
    return sum(p * (j + 1) for j, p in enumerate(outcome_probabilities(PRIOR_ALPHA, k)))


def ssd_pays(costs: StageCosts, sd_round_s: float, k: int, cap: int) -> bool:
    """Whether SSD's prior plan, costed with a lane's contended ``costs``, beats an SD round of
    ``sd_round_s`` timed alone (verify and ``k`` draft steps) under :data:`PRIOR_ALPHA`, :data:`PRIOR_RHO`."""
    return prior_plan(costs, k, cap).rate > prior_tokens(k) / sd_round_s


def why_no_tree_pays(costs: StageCosts, sd_round_s: float, k: int, cap: int, where: str) -> str:
    """Why :func:`ssd_pays` is False, in words with the figures (``where``: how the target and the lane
    ran while timed, e.g. "sharing one GPU")."""
    plan = prior_plan(costs, k, cap)
    build = (costs.glue_s or 0.0) + (k * costs.tree(plan.budget) if plan.budget else 0.0)
    tree = f"{plan.budget} branches" if plan.budget else "no tree, the glue only"
    return (
        f"SSD's best round ({tree}: the verify {1000 * costs.verify(plan.budget):.2f} ms and the "
        f"draft's build {1000 * build:.2f} ms, timed while both run, {where}) is expected to decide "
        f"{plan.rate * sd_round_s / prior_tokens(k):.2f}x the tokens per second of an SD round "
        f"({1000 * sd_round_s:.2f} ms, timed alone)"
    )
