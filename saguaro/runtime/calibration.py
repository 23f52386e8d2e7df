"""Costs measured before an SSD generation, outside its timed rounds and its trace, once per lane and shape.

- :func:`time_verify_alone`: the target's verify with the lane idle, SSD's ideal round (what
  ``overlap_efficiency`` is measured against).
- :meth:`Calibration.ready`: the lane's warm-up (every stage shape called once, so compiles happen here),
  then the planner's costs: each stage alone, then the verify and each build timed while both run.
- :meth:`Calibration.run_as_sd`: whether an SSD generation runs as SD, per lane, batch and sampling (any
  capacity); SSD measured slower is measured again after :data:`REMEASURE_EVERY` generations, the interval
  doubling up to :data:`REMEASURE_MOST`.

Every time is the device's (:class:`~saguaro.runtime.base.timing.Stopwatch`): on CUDA, events on the
stage's own stream, so timing one side never waits for the other's.
"""

from __future__ import annotations

import copy

import torch

from saguaro.core.stages import DRAFT_CHAIN, DRAFT_STEP, TARGET_VERIFY, TARGET_VERIFY_ROUND
from saguaro.runtime.base.model_runner import ModelRunner
from saguaro.runtime.base.timing import Stopwatch

REPEATS = 3


@torch.inference_mode()
def time_verify_alone(
    target: ModelRunner,
    batch: int,
    capacity: int,
    k: int,
    temperature: float,
    vocab_size: int,
    repeats: int = REPEATS,
) -> float:
    """Seconds of one ``target.verify`` at this batch, capacity and temperature: the least of ``repeats``
    calls (noise only adds time), device time on the target's current stream."""
    device = target.spec.device
    store = target.new_store(batch, capacity)
    # distinct, contiguous tensors, as the rounds pass them: an aliased or expanded argument would make
    # a compiling backend guard on it and compile the stage a second time
    positions = torch.arange(k + 1, device=device).repeat(batch, 1)  # [B, k+1]
    slots = positions.clone()  # [B, k+1]
    ids = torch.zeros(batch, k + 1, dtype=torch.long, device=device)
    draft_tokens = torch.zeros(batch, k, dtype=torch.long, device=device)  # [B, k]
    stage = TARGET_VERIFY.for_temperature(temperature)
    extra = (draft_tokens,)
    if temperature == 0 and target.provides(TARGET_VERIFY_ROUND):  # the verify the greedy rounds run
        stage = TARGET_VERIFY_ROUND
        extra = (draft_tokens, *_sequence_buffers(batch, capacity, k, vocab_size, device))
    if temperature > 0:
        probs = torch.full((batch, k, vocab_size), 1.0 / vocab_size, device=device)  # [B, k, V]
        uniforms = torch.full((batch, k + 1), 0.5, device=device)
        extra = (
            draft_tokens,
            probs,
            torch.tensor(1.0 / temperature, device=device),
            uniforms[:, :k],
            uniforms[:, k],
        )
    best = float("inf")
    for _ in range(repeats):
        watch = Stopwatch(device)
        target.run(stage, store, ids, positions, slots, *extra)
        best = min(best, watch.stop().seconds)
    return best


def _sequence_buffers(batch: int, capacity: int, k: int, vocab_size: int, device) -> tuple:
    """Stand-ins for the sequence buffers the greedy round stage takes (tokens, lengths, finished, padding,
    EOS table, end), of the rounds' shapes and dtypes: rows of ``k + 2`` tokens, none finished."""
    return (
        torch.zeros(batch, capacity, dtype=torch.long, device=device),  # [B, S]
        torch.full((batch,), k + 2, dtype=torch.long, device=device),  # [B]
        torch.zeros(batch, dtype=torch.bool, device=device),
        torch.zeros(batch, dtype=torch.long, device=device),
        torch.zeros(vocab_size, dtype=torch.bool, device=device),  # [V]
        torch.tensor(capacity - k - 2, dtype=torch.long, device=device),  # []
    )


REMEASURE_EVERY = 32  # SSD measured slower: SSD runs again after this many generations run as SD ...
REMEASURE_MOST = 256  # ... and after twice as many each time SSD measures slower again, up to this many
WARM_UP_TIMEOUT_S = 3600.0  # compiling every draft stage shape may take minutes on a small CPU


@torch.inference_mode()
def time_sd_round(
    target: ModelRunner,
    draft: ModelRunner,
    batch: int,
    target_capacity: int,
    draft_capacity: int,
    k: int,
    temperature: float,
) -> float:
    """Seconds of an SD round timed alone on the caller's threads: one verify and ``k`` draft steps (each
    the least of :data:`REPEATS`) on stores of the generation's capacities; each model's device time."""
    device = draft.spec.device
    store = draft.new_store(batch, draft_capacity)
    ids, positions, slots = (torch.zeros(batch, 1, dtype=torch.long, device=device) for _ in range(3))
    chained = temperature == 0 and draft.provides(DRAFT_CHAIN)
    stage = DRAFT_CHAIN if chained else DRAFT_STEP.for_temperature(temperature)  # SD's
    extra = ()
    if temperature > 0:
        extra = (torch.tensor(1.0 / temperature, device=device), torch.full((batch,), 0.5, device=device))
    best = float("inf")
    for _ in range(REPEATS):
        watch = Stopwatch(device)
        draft.run(stage, store, ids, positions, slots, *extra)
        best = min(best, watch.stop().seconds)
    verify = time_verify_alone(target, batch, target_capacity, k, temperature, target.spec.vocab_size)
    return verify + k * best


class Calibration:
    """One Program's measured costs, per (lane, batch, capacity, sampled), and its SSD-or-SD verdicts, per
    (lane, batch, sampled)."""

    def __init__(self, target: ModelRunner, draft: ModelRunner | None, k: int):
        self.target = target
        self.draft = draft
        self.k = k
        self._costs: dict = {}
        self._sd_round_s: dict = {}
        self._ssd_over_sd: dict = {}  # verdict key -> last SSD generation's mean round / SD's round alone
        self._planned_sd: dict = {}  # verdict key -> SSD generations run as SD since SSD was last measured
        self._sd_warmed: set = set()  # (padded ids' shape, max_new_tokens, sampled) whose SD shapes ran once
        self._seen_shapes: set = set()  # compile="background": shapes SSD asked for (deferred_for_compiles)
        self._compiled_shapes: set = set()  # ... and those whose SSD costs may be measured now
        self._remeasure: dict = {}  # verdict key -> generations run as SD before SSD is measured again

    @staticmethod
    def _costs_key(lane, spec) -> tuple:
        return (id(lane), spec.input_ids.shape[0], spec.capacity, spec.temperature > 0)

    @staticmethod
    def verdict_key(lane, spec) -> tuple:
        """What an SSD-or-SD verdict holds for: the lane, the batch and sampled or greedy (any capacity)."""
        return (id(lane), spec.input_ids.shape[0], spec.temperature > 0)

    def run_as_sd(self, verdict: tuple, prior_pays: bool) -> bool:
        """Whether an SSD generation of this :meth:`verdict_key` runs as SD: before any measurement, unless
        ``prior_pays``; after, while SSD's last mean round over SD's alone is above 1 and the remeasure
        interval (counted here) runs."""
        ratio = self._ssd_over_sd.get(verdict)
        if ratio is None:
            return not prior_pays
        if ratio <= 1.0:
            self._planned_sd.pop(verdict, None)
            self._remeasure.pop(verdict, None)
            return False
        interval = self._remeasure.get(verdict, REMEASURE_EVERY)
        done = self._planned_sd.get(verdict, 0) + 1
        if done <= interval:
            self._planned_sd[verdict] = done
            return True
        self._planned_sd[verdict] = 0  # this generation measures SSD again
        self._remeasure[verdict] = min(2 * interval, REMEASURE_MOST)
        return False

    def ssd_over_sd(self, verdict: tuple) -> float | None:
        """The last SSD generation's mean round over its SD round timed alone (None: none measured yet)."""
        return self._ssd_over_sd.get(verdict)

    def record_ssd(self, verdict: tuple, round_s: list, sd_round_s: float | None) -> None:
        """Record an SSD generation's rounds (seconds each) against ``sd_round_s``, its shape's SD round
        timed alone (None: no local SD, no verdict)."""
        if round_s and sd_round_s:
            self._ssd_over_sd[verdict] = sum(round_s) / len(round_s) / sd_round_s

    def deferred_for_compiles(self, shape: tuple, compiling) -> bool:
        """``compile="background"``: True (run SD, measure nothing) the first time ``shape`` asks and while
        ``compiling()``; once a call of ``shape`` finds nothing compiling, False for good."""
        if shape in self._compiled_shapes:
            return False
        if shape not in self._seen_shapes or compiling():
            self._seen_shapes.add(shape)
            return True
        self._compiled_shapes.add(shape)
        return False

    def first_sd_warm_up(self, shape: tuple) -> bool:
        """True the first time ``shape`` asks (its SD rounds have not been warmed up yet), False after."""
        if shape in self._sd_warmed:
            return False
        self._sd_warmed.add(shape)
        return True

    def sd_round_s(self, batch: int, target_capacity: int, draft_capacity: int, temperature: float) -> float:
        """An SD round timed alone with the caller's threads, once per shape (:func:`time_sd_round`)."""
        key = (batch, target_capacity, draft_capacity, temperature > 0)
        if key not in self._sd_round_s:
            self._sd_round_s[key] = time_sd_round(
                self.target, self.draft, batch, target_capacity, draft_capacity, self.k, temperature
            )
        return self._sd_round_s[key]

    def ready(self, lane, spec, target_capacity: int) -> tuple:
        """``(verify_alone_s, plan_costs)`` for a generation like ``spec`` on ``lane`` (the target's store of
        ``target_capacity``), warming the lane up for a new shape; ``plan_costs`` None without a planner.
        Raises ``DraftLaneError`` when the lane fails."""
        batch, temperature = spec.input_ids.shape[0], spec.temperature
        key = self._costs_key(lane, spec)
        if key not in self._costs:
            verify = lambda repeats=REPEATS: time_verify_alone(
                self.target, batch, target_capacity, self.k, temperature, self.target.spec.vocab_size, repeats
            )
            for timed_again in (False, True):
                alone = verify()
                costs = copy.deepcopy(lane.warm_up(spec, spec.input_ids[:, -1], timeout_s=WARM_UP_TIMEOUT_S))
                if timed_again or self.target.wait_compiled(timeout=0):
                    break
                self.target.wait_compiled()  # background compiles: eager stages were timed; again, compiled
            if costs is not None:  # both sides of a round timed while both run: the verify and each build
                for budget in sorted(costs.tree_s) + [0]:
                    for _ in range(2):
                        lane.build_budget(budget)
                        costs.observe_verify(budget, verify(1))
                        lane.finished()  # waits for the build
                costs.under_contention(copy.deepcopy(lane.plan_costs()))
            self._costs[key] = (alone, costs)
        return self._costs[key]
