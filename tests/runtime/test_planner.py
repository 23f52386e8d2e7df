"""The speculation planner against exhaustive search on synthetic cost and outcome models, and its
choices at the extremes (a draft lane costlier than the verify gives SD rounds)."""

import itertools

import pytest
import torch

from saguaro.runtime.draft.fan_out import OutcomeEstimator, outcome_probabilities
from saguaro.runtime.draft.planner import Planner, best_fan_out


def power_miss(rho, per_position=None):
    """``miss(j, F) = (F + 1)^(−ρ_j)``: ``ρ`` everywhere, or ``per_position[j]``."""
    return lambda j, f: (f + 1.0) ** (-(per_position[j] if per_position else rho))


def allocations(budget, positions, cap):
    """Every fan-out of exactly ``budget`` branches over ``positions``, each at most ``cap``."""
    for fan in itertools.product(range(cap + 1), repeat=positions):
        if sum(fan) == budget:
            yield list(fan)


def hit_rate(probabilities, miss, fan):
    return sum(p * (1 - miss(j, f)) for j, (p, f) in enumerate(zip(probabilities, fan)))


@pytest.mark.parametrize(
    "alpha,rho,k,budget,cap",
    [
        (0.8, 1.0, 3, 6, 6),
        (0.5, 2.0, 3, 5, 3),
        (0.95, 0.5, 2, 7, 4),
        (0.3, 1.5, 4, 8, 8),
        (0.7, 3.0, 4, 3, 2),
        (0.8, [0.4, 2.0, 1.0, 3.0], 3, 7, 5),
        (0.6, [3.0, 0.3, 0.8], 2, 6, 6),  # positions that miss differently
    ],
)
def test_greedy_fan_out_equals_exhaustive_search(alpha, rho, k, budget, cap):
    probabilities = outcome_probabilities(alpha, k)
    miss = power_miss(rho, rho if isinstance(rho, list) else None)
    fan, rate = best_fan_out(probabilities, miss, budget, cap)
    best = max(hit_rate(probabilities, miss, f) for f in allocations(budget, k + 1, cap))
    assert sum(fan) == budget and max(fan) <= cap
    assert rate == pytest.approx(best, rel=1e-12) and hit_rate(probabilities, miss, fan) == pytest.approx(
        best
    )


def exhaustive_plan(planner, alpha, miss, tokens_on_fast=None):
    """The best (budget, fan-out) over every candidate budget and every allocation of it."""
    k = planner.k
    probabilities = outcome_probabilities(alpha, k)
    tokens = sum(p * (j + 1) for j, p in enumerate(probabilities))
    best = None
    for budget in planner.budgets:
        for fan in allocations(budget, k + 1, planner.cap):
            hit = hit_rate(probabilities, miss, fan)
            miss_tokens, miss_s = (
                (tokens, k * planner.costs.step_s) if tokens_on_fast is None else (tokens_on_fast, 0)
            )
            round_s = planner.expected_round_s(budget, hit, miss_s)
            rate = (hit * tokens + (1 - hit) * miss_tokens) / round_s
            if best is None or rate > best[0] + 1e-12:
                best = (rate, budget, fan)
    return best


def costed_planner(k, budgets, cap, verify, glue, tree, step):
    planner = Planner(k, budgets, cap)
    for budget in budgets:
        planner.costs.observe_verify(budget, verify(budget))
        planner.costs.observe_build(budget, glue, tree(budget) if budget else None)
    planner.costs.observe_step(step)
    return planner


@pytest.mark.parametrize(
    "verify_ms,glue_ms,tree_ms,step_ms",
    [
        (10.0, 1.0, 0.5, 2.0),  # a cheap draft: a tree hides behind the verify
        (10.0, 1.0, 1.5, 2.0),  # a dearer tree: a smaller tree or none
        (10.0, 1.0, 4.0, 1.0),  # the draft lane costs more than the verify: SD rounds
        (5.0, 0.5, 0.2, 3.0),  # misses are dear: the biggest tree
    ],
)
@pytest.mark.parametrize("alpha,rho", [(0.8, 1.0), (0.6, 2.0)])
def test_plan_equals_exhaustive_search_over_small_plans(verify_ms, glue_ms, tree_ms, step_ms, alpha, rho):
    k = 3
    planner = costed_planner(
        k,
        [0, 4, 8],
        4,
        lambda m: verify_ms * 1e-3 * (1 + 0.01 * m),
        glue_ms * 1e-3,
        lambda m: tree_ms * 1e-3 * (1 + 0.05 * m),
        step_ms * 1e-3,
    )
    plan = planner.plan(alpha, power_miss(rho))
    rate, budget, fan = exhaustive_plan(planner, alpha, power_miss(rho))
    assert plan.budget == budget and plan.rate == pytest.approx(rate, rel=1e-9)
    assert hit_rate(outcome_probabilities(alpha, k), power_miss(rho), plan.fan_out) == pytest.approx(
        hit_rate(outcome_probabilities(alpha, k), power_miss(rho), fan)
    )


def test_plan_with_fast_fallback_equals_exhaustive_search():
    planner = costed_planner(3, [0, 4, 8], 4, lambda m: 8e-3, 1e-3, lambda m: 1e-3 + 1e-4 * m, 2e-3)
    plan = planner.plan(0.7, power_miss(1.2), fallback="fast", fast_tokens=1.3)
    rate, budget, _ = exhaustive_plan(planner, 0.7, power_miss(1.2), tokens_on_fast=1.3)
    assert plan.budget == budget and plan.rate == pytest.approx(rate, rel=1e-9)


def test_a_draft_lane_costlier_than_the_verify_yields_sd_rounds():
    planner = costed_planner(5, [0, 6, 12, 18], 64, lambda m: 10e-3, 2e-3, lambda m: 4e-3, 2e-3)
    assert planner.plan(0.8, power_miss(1.0)).budget == 0
    cheap = costed_planner(5, [0, 6, 12, 18], 64, lambda m: 10e-3, 1e-3, lambda m: 0.5e-3, 2e-3)
    assert cheap.plan(0.8, power_miss(1.0)).budget == 18  # the whole tree hides behind the verify


def test_unmeasured_candidates_are_tried_once():
    planner = Planner(5, [0, 6, 12, 18], 64)
    first = planner.plan(0.8, power_miss(1.0))
    assert first.budget == 0  # nothing measured: every plan looks free, the first (SD) is taken
    planner.costs.observe_verify(0, 10e-3)
    planner.costs.observe_build(0, 1e-3, None)
    planner.costs.observe_step(2e-3)
    assert planner.plan(0.8, power_miss(1.0)).budget == 18  # an unmeasured tree counts as free
    planner.costs.observe_build(18, 1e-3, 5e-3)  # measured: 26 ms of draft work
    planner.costs.observe_verify(18, 12e-3)
    assert planner.plan(0.8, power_miss(1.0)).budget == 12  # the next unmeasured one is tried


def pareto_ranks(rho, n, seed):
    u = torch.rand(n, generator=torch.Generator().manual_seed(seed))
    return torch.floor(u ** (-1.0 / rho)).long() - 1  # P(rank >= F) = (F + 1)^-ρ


def test_planning_miss_function_fits_the_observed_ranks_per_position():
    est = OutcomeEstimator(2)
    assert est.miss_function()(1, 3) == pytest.approx(4.0**-1.0)  # the prior before any rank
    # position 0 misses often (ρ 0.5), position 2 rarely (ρ 2.5); position 1 is never seen
    accepted = torch.cat([torch.zeros(20000, dtype=torch.long), torch.full((20000,), 2)])
    ranks = torch.cat([pareto_ranks(0.5, 20000, 1), pareto_ranks(2.5, 20000, 2)])
    est.observe(accepted, ranks)
    miss = est.miss_function()
    assert miss(0, 0) == 1.0 and miss(2, 0) == 1.0
    assert miss(0, 3) == pytest.approx(4.0**-0.5, rel=0.1)
    assert miss(2, 3) == pytest.approx(4.0**-2.5, rel=0.2)
    assert miss(2, 3) < miss(1, 3) < miss(0, 3)  # the unseen position takes the overall fit
    # and the planner moves branches to the position that misses
    fan, _ = best_fan_out([0.3, 0.3, 0.4], miss, 9, 9)
    assert fan[0] > fan[2]


def test_ssd_pays_only_where_its_best_plan_beats_plain_sd():
    from saguaro.runtime.draft.planner import StageCosts, ssd_pays

    cheap = StageCosts(
        glue_s=1e-3, step_s=2e-3, tree_s={6: 0.5e-3, 12: 0.6e-3}, verify_s={0: 10e-3, 6: 10e-3, 12: 10e-3}
    )
    assert ssd_pays(cheap, sd_round_s=20e-3, k=5, cap=64)  # the tree hides behind a 10 ms verify; SD takes 20
    assert not ssd_pays(cheap, sd_round_s=6e-3, k=5, cap=64)  # SD on every core is faster than any SSD round
    dear = StageCosts(
        glue_s=3e-3, step_s=2e-3, tree_s={6: 4e-3, 12: 5e-3}, verify_s={0: 10e-3, 6: 12e-3, 12: 13e-3}
    )
    assert not ssd_pays(dear, sd_round_s=18e-3, k=5, cap=64)  # 23+ ms of draft work per round


@pytest.mark.parametrize("pays", [False, True])
def test_a_generation_no_tree_pays_for_runs_as_sd_and_says_so(monkeypatch, pays):
    import saguaro
    from saguaro.bench.report import format_table
    from saguaro.bench.rows import time_row
    from saguaro.cli.generate import stats_line
    from saguaro.runtime import generation_plan
    from saguaro.runtime.base.stats import run_label
    from tests.conftest import tiny_pair
    from tests.models import prompts, reference_greedy

    target, draft, _ = tiny_pair("llama")
    program = saguaro.compile(
        target, draft, k=3, mode="ssd", lane="thread", backend="eager"
    )  # sd_when_faster
    monkeypatch.setattr(generation_plan, "ssd_pays", lambda *args: pays)
    ids, mask = prompts(2, 8, seed=2, pad_rows={1: 3})
    try:
        out = program.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None, trace=True)
        row = time_row(target, draft, program, [ids[:1]], "ssd", 3, 8, 0.0, 1, 0)  # the bench's ssd row
    finally:
        program.close()
    assert torch.equal(out.sequences, reference_greedy(target, ids, mask, 12))
    assert out.stats["mode"] == "ssd" and out.stats["planned_sd"] is (not pays)
    assert ("no tree pays here" in out.stats["plan"]) is (not pays)  # the plan says why, in words
    # and every surface says so in words: stats, trace metadata, the bench table and the CLI's line
    label = "ssd (ran as SD: no tree pays here)" if not pays else "ssd"
    assert out.stats["ran_as"] == ("sd" if not pays else "ssd") and run_label(out.stats) == label
    assert out.trace["otherData"]["mode"] == label and out.trace["otherData"]["ran_as"] == out.stats["ran_as"]
    if not pays:  # (where a tree pays, the bench row's later calls follow their measured rounds: SD or SSD)
        assert row["planned_sd_fraction"] == 1.0 and format_table([row]).splitlines()[2].startswith(
            label + "  "
        )
    assert stats_line(out.stats).startswith("[ssd, ran as SD: no tree pays here] " if not pays else "[ssd] ")
    if not pays:  # SD's rounds: no lookup, the draft decoded on the caller's thread
        assert (
            out.stats["cache_hit_rate"] == 0.0
            and out.stats["draft_s"] > 0
            and out.stats["verify_alone_s"] > 0
        )


def test_ssd_verdicts_follow_their_measured_rounds_across_capacities_and_are_measured_again():
    from types import SimpleNamespace

    from saguaro.runtime.calibration import REMEASURE_EVERY, REMEASURE_MOST, Calibration

    assert (REMEASURE_EVERY, REMEASURE_MOST) == (32, 256)  # exploration: at most ~1 generation in 33
    calibration, lane = Calibration(None, None, 5), object()
    spec = lambda capacity, batch=1, temperature=0.0: SimpleNamespace(
        input_ids=torch.zeros(batch, 3, dtype=torch.long), capacity=capacity, temperature=temperature
    )
    key = calibration.verdict_key(lane, spec(256))
    assert calibration.verdict_key(lane, spec(512)) == key  # the store's capacity is no part of the verdict
    assert calibration.verdict_key(lane, spec(256, batch=2)) != key
    assert calibration.verdict_key(lane, spec(256, temperature=1.0)) != key
    assert calibration.verdict_key(object(), spec(256)) != key
    assert calibration.run_as_sd(key, prior_pays=True) is False  # nothing measured: the prior decides
    assert calibration.run_as_sd(key, prior_pays=False) is True
    calibration.record_ssd(key, [8e-3, 9e-3], None)  # no local SD to compare: no verdict
    assert calibration.run_as_sd(key, prior_pays=False) is True
    calibration.record_ssd(key, [8e-3, 9e-3], 10e-3)  # SSD's rounds beat SD's: SSD, whatever the prior
    assert [calibration.run_as_sd(key, prior_pays=False) for _ in range(3)] == [False] * 3
    # slower than SD, measured at one capacity: a second capacity (the same lane, batch, sampling) reuses
    # the ratio, 3 ms over 2 ms, against its own SD round: SD, no prior and no SSD generation to measure it
    calibration.record_ssd(key, [3e-3, 3e-3], 2e-3)
    key_512 = calibration.verdict_key(lane, spec(512))
    choices = [calibration.run_as_sd(key_512, prior_pays=True) for _ in range(742)]
    ssd_at = [i for i, as_sd in enumerate(choices) if not as_sd]
    assert choices[:REMEASURE_EVERY] == [True] * REMEASURE_EVERY  # the first SSD comes after 32 as SD ...
    # ... and after twice as many each time SSD stays slower (as it does: no record), up to REMEASURE_MOST
    assert ssd_at == [32, 32 + 1 + 64, 97 + 1 + 128, 226 + 1 + 256, 483 + 1 + 256]
    assert [b - a - 1 for a, b in zip([-1] + ssd_at, ssd_at)] == [32, 64, 128, 256, 256]
    assert choices[-1] is True
    calibration.record_ssd(
        key_512, [9e-3], 10e-3
    )  # the machine changed: SSD pays again, SSD at once and after
    assert [calibration.run_as_sd(key, prior_pays=False) for _ in range(3)] == [False] * 3
    calibration.record_ssd(key, [14e-3, 16e-3], 10e-3)  # slower once more: the interval starts again from 32
    choices = [calibration.run_as_sd(key, prior_pays=True) for _ in range(REMEASURE_EVERY + 2)]
    assert choices == [True] * REMEASURE_EVERY + [False, True]
    other = calibration.verdict_key(lane, spec(256, temperature=1.0))  # sampled: a verdict of its own
    assert (
        calibration.run_as_sd(other, prior_pays=True) is False and calibration.run_as_sd(other, False) is True
    )


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sd_shapes_are_warmed_once_before_the_first_generation_run_as_sd(monkeypatch, temperature):
    """SD's rounds call shapes SSD's warm-up does not (an Inductor stage would compile them inside the
    generation): the first SSD generation of a shape also runs two SD rounds untimed, the next one does
    not, and neither the tokens nor a seed's draws change."""
    import saguaro
    from saguaro.runtime import generation_plan
    from saguaro.runtime.program import Program
    from tests.conftest import tiny_pair
    from tests.models import prompts, reference_greedy

    target, draft, _ = tiny_pair("llama")
    program = saguaro.compile(
        target, draft, k=3, mode="ssd", lane="thread", backend="eager"
    )  # sd_when_faster
    monkeypatch.setattr(generation_plan, "ssd_pays", lambda *args: False)
    decodes, rounds = [], []
    real = Program._decode

    def counting(self, plan, *args, **options):
        decodes.append(plan.run)
        on_round = args[-1]
        return real(
            self,
            plan,
            *args[:-1],
            lambda seqs: (rounds.append(plan.run), on_round and on_round(seqs)),
            **options,
        )

    monkeypatch.setattr(Program, "_decode", counting)
    ids, mask = prompts(1, 8, seed=3)
    try:
        outs = [
            program.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=12,
                eos_token_id=None,
                temperature=temperature,
                seed=5,
            )
            for _ in range(2)
        ]
    finally:
        program.close()
    assert decodes == ["sd", "sd", "sd"]  # the warm-up, then each generation
    assert rounds.count("sd") > 3 and all(o.stats["ran_as"] == "sd" for o in outs)
    assert torch.equal(outs[0].sequences, outs[1].sequences)  # the warm-up drew from its own generator
    if temperature == 0.0:
        assert torch.equal(outs[0].sequences, reference_greedy(target, ids, mask, 12))
