"""What one ``generate`` call runs, decided before its clock starts: a :class:`GenerationPlan`.

AR and SD run as asked. SSD needs a draft lane (none can start: SD, the same tokens), warmed up and costed
for the shape (:mod:`saguaro.runtime.calibration`). Where no tree pays, SD timed alone is faster and the
rounds run SD's (``sd_when_faster``; the stats stay SSD's, ``stats["plan"]`` says why). The verdict holds
per lane, batch and sampling (:meth:`~saguaro.runtime.calibration.Calibration.run_as_sd`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from saguaro.core.warnings_at_caller import warn_at_caller
from saguaro.runtime.draft.planner import ssd_pays, why_no_tree_pays
from saguaro.runtime.draft.server import GenerateSpec
from saguaro.runtime.lanes.protocol import DraftClient, DraftLaneError
from saguaro.runtime.lanes.streams import same_gpu


@dataclass(frozen=True)
class GenerationPlan:
    """The plan of one call; SSD's fields are None for AR and SD."""

    mode: str  # what the stats report: the mode asked, or "sd" where no lane could serve SSD
    run: str  # the rounds run: "ar", "sd" or "ssd"
    why: str  # in words
    lane: DraftClient | None = None  # SSD's
    tree_policy: str = "none"  # of SSD's draft side
    calibrated: tuple | None = None  # SSD's (verify_alone_s, plan_costs), kept when it runs as SD
    spec: GenerateSpec | None = None  # what SSD's draft side is opened with
    sd_round_s: float | None = None  # an SD round of this shape timed alone (SSD with a local draft)
    made_for: tuple | None = None  # the call Program.plan made it for (what generate(plan=...) checks)

    @property
    def planned_sd(self) -> bool:
        """SSD was asked and a lane was ready, and the planner ran SD's rounds instead."""
        return self.mode == "ssd" and self.run == "sd" and self.calibrated is not None


def plan_stats(plan: GenerationPlan, runners) -> dict:
    """``stats``' ``"plan"`` (why, and each stage run without its CUDA graphs), ``"ran_as"`` and
    ``"graphs_off"`` (``{stage: why}`` of the local ``runners``; a process lane's draft is not seen)."""
    off = {
        stage: why for runner in runners if runner is not None for stage, why in runner.graphs_off().items()
    }
    why = plan.why + "".join(
        f"; {stage} runs without CUDA graphs ({reason})" for stage, reason in off.items()
    )
    return {"plan": why, "ran_as": plan.run, "graphs_off": off}


COMPILING = (
    "the stages are still compiling (compile='background'): SD's rounds, the same tokens, until SSD's "
    "costs can be timed on compiled stages"
)
GRAMMAR = (
    "a grammar constrains this call (structured output): SSD's draft lane cannot carry each row's grammar state "
    "through its tree, so SD's rounds run, the draft masked by the grammar as the target is (the same tokens)"
)


def grammar_plan(
    program, mode: str, plan: GenerationPlan | None, temperature: float, key: tuple
) -> GenerationPlan | None:
    """The plan of a call (``key``: what ``made_for`` holds) under a grammar in mode ``ssd``: SD's rounds (or AR's
    without a local draft), stats still mode ``ssd`` (``ran_as`` says what ran, ``plan`` says why); ``plan``: one
    ``Program.plan`` made (its ``made_for`` kept, for the caller's check), or None. Other modes: ``plan``."""
    if mode != "ssd" or (plan is not None and plan.run != "ssd"):
        return plan
    if plan is None:
        program.prepare(program.without_lane, temperature)
    return GenerationPlan(mode, program.without_lane, GRAMMAR, made_for=plan.made_for if plan else key)


def plan_call(program, mode: str, call: tuple, base: int | None) -> GenerationPlan:
    """What one ``generate`` call does before its clock starts: build the stages ``mode`` needs, then
    :func:`plan_generation` and :func:`warm_sd_shapes`. ``call``: ``(padded_ids, padded_mask,
    max_new_tokens, eos_ids, temperature)``. SSD runs SD while :func:`still_compiling` (nothing timed)."""
    padded_ids, padded_mask, max_new_tokens, eos_ids, temperature = call
    if mode == "ssd" and still_compiling(program, (tuple(padded_ids.shape), max_new_tokens, temperature > 0)):
        program.prepare(program.without_lane, temperature)
        return GenerationPlan(mode, program.without_lane, COMPILING)
    if mode == "ssd":
        program.lanes.begin_call()  # a remote lane that failed to start is tried again on each call
    program.prepare(
        program.without_lane if mode == "ssd" and program.lanes.lane() is None else mode, temperature
    )
    spec = None  # what SSD's draft side is opened with; AR and SD have no draft lane
    if mode == "ssd":
        spec = program._draft_spec(padded_ids, padded_mask, max_new_tokens, eos_ids, temperature, base)
    plan = plan_generation(program, mode, spec, program._store_capacity(padded_ids.shape[1], max_new_tokens))
    warm_sd_shapes(program, plan, call, base)
    return plan


def still_compiling(program, shape: tuple) -> bool:
    """With background compiles, the planner on and a local draft: True the first time ``shape`` asks and
    while compiles are queued, until its SSD costs are measured (they are timed on compiled stages only)."""
    config = program.config
    if (
        config.backend != "inductor"
        or config.compile != "background"
        or not config.sd_when_faster
        or program.draft is None
    ):
        return False
    return program.calibration.deferred_for_compiles(shape, lambda: not program.wait_compiled(timeout=0))


def plan_generation(program, mode: str, spec: GenerateSpec | None, target_capacity: int) -> GenerationPlan:
    """The plan of one call of ``program`` in ``mode`` (``spec``: the draft side's, for SSD)."""
    if mode != "ssd":
        return GenerationPlan(mode, mode, f"mode {mode} asked")
    lane = program.lanes.lane()
    alone = program.without_lane  # SD, or AR with a remote draft only
    if lane is None:
        return GenerationPlan(
            alone,
            alone,
            f"ssd asked, but no draft lane can start ({program.lanes.failure}): "
            f"{alone.upper()} gives the same tokens",
        )
    config = program.config
    batch = spec.input_ids.shape[0]
    tree_policy = "planner" if config.fan_out == "auto" else f"fan_out={config.fan_out!r}"
    sd_round_s = None  # SD on the target's machine (every core; no SD without a local draft)
    try:
        if program.draft is not None:
            # SD as it would run: its draft store holds no tree scratch (the target's capacity)
            sd_round_s = program.calibration.sd_round_s(
                batch, target_capacity, target_capacity, spec.temperature
            )
        with program.lanes.ssd_context(spec.input_ids.device):  # timed as the rounds run
            calibrated = program.calibration.ready(lane, spec, target_capacity)
    except DraftLaneError as exc:
        warn_at_caller(f"saguaro: {exc}; generating with {alone.upper()} instead (output stays exact)")
        program.lanes.drop()
        return GenerationPlan(
            alone, alone, f"ssd asked, but the {lane.kind} lane failed while warming up: {exc}"
        )
    verdict = program.calibration.verdict_key(lane, spec)
    costs = calibrated[1]
    if (
        config.sd_when_faster
        and costs is not None
        and sd_round_s is not None
        and program.calibration.run_as_sd(verdict, ssd_pays(costs, sd_round_s, config.k, program.draft_width))
    ):
        return GenerationPlan(
            mode,
            "sd",
            f"no tree pays here: {_why_sd(program, verdict, costs, sd_round_s)} (sd_when_faster=True)",
            tree_policy=tree_policy,
            calibrated=calibrated,
            spec=spec,
            sd_round_s=sd_round_s,
        )
    return GenerationPlan(
        mode, "ssd", f"SSD on the {lane.kind} lane", lane, tree_policy, calibrated, spec, sd_round_s
    )


def _why_sd(program, verdict: tuple, costs, sd_round_s: float) -> str:
    """Why an SSD generation runs as SD, in words: the last SSD generation's measured rounds, or before any,
    the planner's estimate from the contended costs."""
    ratio = program.calibration.ssd_over_sd(verdict)
    if ratio is not None:
        return (
            f"the last SSD generation at this batch took {ratio:.2f}x an SD round's time ({1000 * sd_round_s:.2f} "
            "ms, timed alone) a round; SSD runs again now and then to measure it anew"
        )
    device = program.target.spec.device
    if not program.lanes.shares_host:
        where = "the draft on a machine of its own"
    elif device.type == "cpu":
        where = "each on its share of the cores"
    else:
        where = (
            "sharing one GPU"
            if same_gpu(device, program.draft.spec.device)
            else "each on a device of its own"
        )
    return why_no_tree_pays(costs, sd_round_s, program.config.k, program.draft_width, where)


class _Warmed(Exception):
    """Ends :func:`warm_sd_shapes`'s generation once its rounds have run."""


WARM_SD_ROUNDS = 2  # the first round's draft catches up with one token; a later one may catch up with two


def warm_sd_shapes(program, plan: GenerationPlan, call: tuple, base: int | None) -> None:
    """Run :data:`WARM_SD_ROUNDS` untimed SD rounds before a shape's first SSD generation the planner may
    run as SD, so the switch never compiles inside a generation (SSD's warm-up calls other shapes).
    ``call``: as :func:`plan_call`'s; sampled, it draws from its own generator seeded ``base``."""
    if not (
        plan.mode == "ssd"
        and plan.calibrated is not None
        and plan.sd_round_s is not None
        and program.config.sd_when_faster
    ):
        return
    padded_ids, padded_mask, max_new_tokens, eos_ids, temperature = call
    if not program.calibration.first_sd_warm_up((tuple(padded_ids.shape), max_new_tokens, temperature > 0)):
        return
    generator = None
    if temperature > 0:
        generator = torch.Generator(device=program.target.spec.device).manual_seed(base)
    rounds = []

    def stop(seqs) -> None:
        rounds.append(1)
        if len(rounds) > WARM_SD_ROUNDS:  # the prefill's token, then the rounds
            raise _Warmed

    try:
        program._decode(
            replace(plan, run="sd", lane=None),
            padded_ids,
            padded_mask,
            max_new_tokens,
            eos_ids,
            temperature,
            generator,
            None,
            stop,
        )
    except _Warmed:
        pass
