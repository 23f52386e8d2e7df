"""The planner charges what the verify and the draft lane's build cost while both run (one GPU, or the
lanes' share of the cores), not what each costs alone: calibration hands it the contended costs, the
tree is chosen (or SD) by them, and a generation run as SD says why in words, with the figures."""

from types import SimpleNamespace

import pytest
import torch

from saguaro.runtime import calibration as calibration_module
from saguaro.runtime.calibration import Calibration
from saguaro.runtime.draft.planner import Planner, StageCosts, ssd_pays, why_no_tree_pays

K, BUDGETS, CAP = 3, [0, 4, 8], 8
VERIFY_ALONE_S, STEP_S = 6e-3, 2e-3


def miss(j, f):
    return (f + 1.0) ** -1.5


def solo_costs() -> StageCosts:
    """Each stage timed alone: a cheap build (0.5 ms glue + 3 depths of 0.4-0.6 ms) under a 6 ms verify."""
    return StageCosts(glue_s=0.5e-3, step_s=STEP_S, tree_s={4: 0.4e-3, 8: 0.6e-3})


def contended(verify_ms: float, glue_ms: float, tree_ms: dict) -> StageCosts:
    """What calibration measures while both run: the verify per branch count, and the builds."""
    costs = solo_costs().under_contention(
        StageCosts(glue_s=glue_ms * 1e-3, tree_s={m: t * 1e-3 for m, t in tree_ms.items()})
    )
    for budget in BUDGETS:
        costs.observe_verify(budget, verify_ms * 1e-3 * (1 + 0.02 * budget))
    return costs


def plan(costs: StageCosts):
    planner = Planner(K, BUDGETS, CAP)
    planner.costs = costs
    return planner.plan(0.8, miss)


def test_contended_builds_replace_the_solo_ones_and_the_rest_is_kept():
    costs = solo_costs().under_contention(StageCosts(glue_s=2e-3, tree_s={8: 3e-3}))
    assert costs.glue_s == 2e-3 and costs.tree_s == {4: 0.4e-3, 8: 3e-3} and costs.step_s == STEP_S
    assert solo_costs().under_contention(None).tree_s == solo_costs().tree_s  # nothing measured: as alone
    assert solo_costs().under_contention(StageCosts()).glue_s == 0.5e-3


def test_a_tree_that_pays_alone_but_not_under_contention_gives_sd_rounds():
    # the verify slowed from 6 to 7 ms and the build to 1.5 + 3 x 4-4.5 ms: no tree hides behind it
    dear = contended(7.0, 1.5, {4: 4.0, 8: 4.5})
    assert plan(dear).budget == 0
    # a mild contention: the tree still hides behind the verify, the biggest one pays
    mild = contended(6.5, 0.6, {4: 0.5, 8: 0.7})
    assert plan(mild).budget == 8
    # and the round the planner expects is the contended one: max(verify(M), build(M)) on a hit
    chosen = plan(mild)
    expected = max(mild.verify(8), mild.glue_s + K * mild.tree(8)) + (1 - chosen.hit_rate) * K * STEP_S
    assert chosen.round_s == pytest.approx(expected)


def test_whether_ssd_pays_over_sd_is_decided_with_the_contended_costs():
    sd_round_s = VERIFY_ALONE_S + K * STEP_S  # 12 ms: SD timed alone
    assert ssd_pays(contended(6.5, 0.6, {4: 0.5, 8: 0.7}), sd_round_s, K, CAP)
    assert not ssd_pays(contended(7.0, 1.5, {4: 4.0, 8: 4.5}), sd_round_s, K, CAP)
    why = why_no_tree_pays(contended(7.0, 1.5, {4: 4.0, 8: 4.5}), sd_round_s, K, CAP, "sharing one GPU")
    assert "timed while both run, sharing one GPU" in why and "12.00 ms, timed alone" in why
    assert "the verify 7.00 ms" in why and "no tree, the glue only" in why  # M = 0: the build is the glue
    assert "the draft's build 1.50 ms" in why
    tree = why_no_tree_pays(
        contended(6.5, 0.6, {4: 0.5, 8: 0.7}), 1e-3, K, CAP, "each on its share of the cores"
    )
    assert "(8 branches: the verify 7.54 ms and the draft's build 2.70 ms" in tree


class FakeLane:
    """A lane whose warm-up times each stage alone and whose builds, timed while the verify runs, cost
    more (``plan_costs``); it records what the calibration asked, in order."""

    def __init__(self):
        self.log, self.building = [], None

    def warm_up(self, spec, first_tokens, timeout_s):
        self.log.append("warm_up")
        return solo_costs()

    def build_budget(self, budget):
        self.log.append(("build", budget))
        self.building = budget

    def finished(self):
        self.building = None
        return False

    def plan_costs(self):
        self.log.append("plan_costs")
        return StageCosts(glue_s=1.5e-3, tree_s={4: 4.0e-3, 8: 4.5e-3})


def test_calibration_times_the_verify_against_each_build_and_keeps_the_contended_builds(monkeypatch):
    lane = FakeLane()
    # the verify takes 6 ms alone and 7 ms + 0.1 ms per branch while the lane builds
    monkeypatch.setattr(
        calibration_module,
        "time_verify_alone",
        lambda *args: VERIFY_ALONE_S if lane.building is None else 7e-3 + 1e-4 * lane.building,
    )
    target = SimpleNamespace(wait_compiled=lambda timeout=None: True, spec=SimpleNamespace(vocab_size=16))
    spec = SimpleNamespace(input_ids=torch.zeros(1, 4, dtype=torch.long), capacity=64, temperature=0.0)
    alone, costs = Calibration(target, None, K).ready(lane, spec, 64)
    assert alone == VERIFY_ALONE_S
    assert lane.log == [
        "warm_up",
        ("build", 4),
        ("build", 4),
        ("build", 8),
        ("build", 8),
        ("build", 0),
        ("build", 0),
        "plan_costs",
    ]
    assert costs.verify_s == pytest.approx({4: 7.4e-3, 8: 7.8e-3, 0: 7e-3})  # the verify against each build
    assert (costs.glue_s, costs.tree_s, costs.step_s) == (1.5e-3, {4: 4.0e-3, 8: 4.5e-3}, STEP_S)
    assert not ssd_pays(costs, VERIFY_ALONE_S + K * STEP_S, K, CAP)  # alone, the tree would have paid:
    assert ssd_pays(_with_verify(solo_costs(), costs), VERIFY_ALONE_S + K * STEP_S, K, CAP)


def _with_verify(solo: StageCosts, measured: StageCosts) -> StageCosts:
    solo.verify_s = dict(measured.verify_s)
    return solo


def test_a_generation_plans_with_the_contended_costs_and_says_why_in_words(monkeypatch):
    """The decision a GPU takes is this one: calibration's contended costs against SD's round timed alone
    (fixed here), SD where no tree pays, with the figures in ``stats["plan"]``; once an SSD generation has
    run, its measured rounds decide, and the plan says so."""
    import saguaro
    from tests.conftest import tiny_pair
    from tests.models import prompts, reference_greedy

    target, draft, _ = tiny_pair("llama")
    program = saguaro.compile(
        target, draft, k=K, mode="ssd", lane="thread", backend="eager"
    )  # sd_when_faster
    chosen = {"costs": contended(7.0, 1.5, {4: 4.0, 8: 4.5})}
    monkeypatch.setattr(
        Calibration, "ready", lambda self, lane, spec, capacity: (VERIFY_ALONE_S, chosen["costs"])
    )
    monkeypatch.setattr(Calibration, "sd_round_s", lambda self, *args: VERIFY_ALONE_S + K * STEP_S)
    ids, mask = prompts(1, 8, seed=7)
    expected = reference_greedy(target, ids, mask, 12)
    generate = lambda: program.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None)
    try:
        as_sd = generate()
        chosen["costs"] = contended(6.5, 0.6, {4: 0.5, 8: 0.7})  # a mild contention: the tree pays
        program.calibration = Calibration(program.target, program.draft, K)  # no verdict measured yet
        as_ssd = generate()
        for key in list(program.calibration._ssd_over_sd):  # the SSD generation measured 2x SD's round
            program.calibration.record_ssd(key, [24e-3], 12e-3)
        measured = generate()
    finally:
        program.close()
    for out in (as_sd, as_ssd, measured):
        assert torch.equal(out.sequences, expected)
    assert as_sd.stats["ran_as"] == "sd" and as_sd.stats["planned_sd"] is True
    # M = 0 costs max(7, 1.5) ms + 3 x 2 ms of neural fallback = 13 ms a round against SD's 12: 12 / 13 = 0.92
    assert as_sd.stats["plan"] == (
        "no tree pays here: SSD's best round (no tree, the glue only: the verify 7.00 ms and the draft's build "
        "1.50 ms, timed while both run, each on its share of the cores) is expected to decide 0.92x the tokens per "
        "second of an SD round (12.00 ms, timed alone) (sd_when_faster=True)"
    )
    assert as_ssd.stats["ran_as"] == "ssd" and as_ssd.stats["plan"] == "SSD on the thread lane"
    assert measured.stats["ran_as"] == "sd" and measured.stats["plan"].startswith(
        "no tree pays here: the last SSD generation at this batch took 2.00x an SD round's time (12.00 ms, timed "
        "alone)"
    )


@pytest.mark.parametrize(
    "target, draft, shares_host, where",
    [
        (
            "cuda:0",
            "cuda:0",
            True,
            "sharing one GPU",
        ),  # the one-GPU case: the same words as on CPU, its figures
        ("cuda:0", "cuda:1", True, "each on a device of its own"),  # draft_device
        ("cuda:0", "cuda:0", False, "the draft on a machine of its own"),
        ("cpu", "cpu", True, "each on its share of the cores"),
    ],
)
def test_the_words_say_where_the_contended_costs_were_timed(target, draft, shares_host, where):
    from saguaro.runtime.generation_plan import _why_sd

    program = SimpleNamespace(
        calibration=SimpleNamespace(ssd_over_sd=lambda verdict: None),
        lanes=SimpleNamespace(shares_host=shares_host),
        target=SimpleNamespace(spec=SimpleNamespace(device=torch.device(target))),
        draft=SimpleNamespace(spec=SimpleNamespace(device=torch.device(draft))),
        config=SimpleNamespace(k=K),
        draft_width=CAP,
    )
    costs = contended(7.0, 1.5, {4: 4.0, 8: 4.5})
    assert _why_sd(program, ("verdict",), costs, 12e-3) == why_no_tree_pays(costs, 12e-3, K, CAP, where)
    assert f"timed while both run, {where})" in _why_sd(program, ("verdict",), costs, 12e-3)
