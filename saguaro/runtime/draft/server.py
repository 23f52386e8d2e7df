"""The draft side of SSD: everything the draft lane owns, behind five methods.

``open`` prefills the draft on the prompt; ``start`` takes the target's first token and decodes the
first speculation; ``build`` runs glue, fork and tree decode for the speculation now under
verification (this is what overlaps the target); ``match`` takes the outcome ``(a, r')``, commits it
and looks it up in the speculation cache; ``fallback`` makes the next speculation of the rows that
missed. The server keeps its own mirror of the sequences, so a lane can run it unchanged on a worker
thread or in another process: a lane only ever calls these methods by name with tensor arguments.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

from saguaro.core.config import SaguaroConfig
from saguaro.core.schedule import build_steps, round_schedule
from saguaro.core.stages import DRAFT_PREFILL
from saguaro.runtime.draft import tree
from saguaro.runtime.draft.fallback import FallbackPolicy, fast_fallback, neural_fallback
from saguaro.runtime.draft.fan_out import OutcomeEstimator, geometric_fan_out, resolve_fan_out
from saguaro.runtime.base.model_runner import ModelRunner
from saguaro.runtime.draft.planner import Planner, StageCosts
from saguaro.runtime.base.sequences import SequenceBatch
from saguaro.runtime.base.stats import SOURCES, since
from saguaro.runtime.base.trace import TraceRecorder, traced
from saguaro.tensor_math.fork import ranks_from_ranked
from saguaro.tensor_math.verification import outcome_tokens

HIT = SOURCES.index("hit")


@dataclass
class GenerateSpec:
    """What the draft side needs to mirror one ``generate`` call."""

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    max_new_tokens: int
    capacity: int
    eos_token_ids: list
    pad_token_id: int
    temperature: float
    seed: int | None
    plan_costs: object = None  # StageCosts measured when the lane warmed up: the planner's starting costs


@dataclass
class Speculation:
    """The speculation of the next round and where each row's came from."""

    tokens: torch.Tensor  # [B, K]
    probs: torch.Tensor | None  # [B, K, V]; None when greedy
    source: torch.Tensor  # [B] long, index into SOURCES
    fallback_kind: str | None = None  # the fallback the missed rows took, if any


@dataclass
class Lookup:
    """The speculation cache's answer to an outcome: ``hit [B]`` and the cached speculation (rows that
    missed hold filler until :meth:`SpeculationServer.fallback` replaces it)."""

    hit: torch.Tensor  # [B] bool
    speculation: Speculation


class SpeculationServer:
    """Draft-side state of one generation at a time."""

    def __init__(self, draft: ModelRunner, config: SaguaroConfig):
        self.draft = draft
        self.config = config
        self.k = config.k
        self.vocab = draft.spec.vocab_size

    def open(self, spec: GenerateSpec) -> None:
        with traced(self.draft.recorder, "draft", "open (prefill)"):
            self._open(spec)

    def _open(self, spec: GenerateSpec) -> None:
        self.seqs = SequenceBatch(spec.input_ids, spec.attention_mask, spec.max_new_tokens, spec.capacity,
                                  spec.eos_token_ids, spec.pad_token_id)
        self.store = self.draft.new_store(self.seqs.batch, spec.capacity)
        self.temperature = spec.temperature
        self.generator = None
        if spec.temperature > 0:
            self.generator = torch.Generator(device=spec.input_ids.device).manual_seed(spec.seed)
        self.estimator = OutcomeEstimator(self.k)
        schedule = round_schedule("ssd", self.k, sampled=spec.temperature > 0)
        self.build_nodes = [schedule.nodes[n] for n in build_steps(schedule)]
        sampled, costs = spec.temperature > 0, spec.plan_costs
        # sampled generations plan from the warm-up's costs only, so that a seed fixes the tokens
        fixed = (costs.verify(0), self.k * (costs.step_s or 0.0)) if sampled and costs is not None else None
        self.policy = FallbackPolicy(self.config.fallback, self.seqs.batch, fixed, timed=not sampled)
        self.planner = self._new_planner()
        if self.planner is not None and costs is not None:
            self.planner.costs = copy.deepcopy(costs)
            self.planner.adaptive = not sampled
        self.cache = None
        T = self.seqs.prompt_len
        index = torch.arange(T, device=spec.input_ids.device).expand(self.seqs.batch, T)
        self.draft.run(DRAFT_PREFILL, self.store, self.seqs.tokens[:, :T], self.seqs.prompt_positions(), index)

    def start(self, first_tokens: torch.Tensor) -> Speculation:
        """The target's first token ``[B]`` arrives: decode the first speculation with the draft."""
        with traced(self.draft.recorder, "draft", "start (first speculation)"):
            return self._start(first_tokens)

    def _start(self, first_tokens: torch.Tensor) -> Speculation:
        self.seqs.append(first_tokens[:, None], torch.ones_like(first_tokens))
        rows = torch.arange(self.seqs.batch, device=first_tokens.device)
        tokens, probs = neural_fallback(self.draft, self.store, self.seqs, rows, self.k, self.temperature,
                                        self.generator)
        self.current = Speculation(tokens, probs, torch.zeros(self.seqs.batch, dtype=torch.long))
        return self.current

    def build(self, fan_out: list | None = None) -> None:
        """Glue, fork and tree decode for the speculation under verification (overlaps the target), with
        the planner's fan-out (or the configured one), unless ``fan_out`` is given."""
        seqs, k = self.seqs, self.k
        if fan_out is not None:
            self.fan_out = list(fan_out)
        elif self.planner is not None:
            fast = self.policy.accepted["fast"][-32:]
            self.fan_out = self.planner.plan(self.estimator.alpha, self.estimator.miss_function(),
                                             self.policy.choose(), sum(fast) / len(fast) if fast else 1.0).fan_out
        else:
            self.fan_out = self._fixed_fan_out()
        recorder = self.draft.recorder
        if recorder is not None:
            recorder.counter("draft", "branch budget", MQ=sum(self.fan_out))
            recorder.counter("draft", "fan-out", **{f"F{j}": f for j, f in enumerate(self.fan_out)})
        with traced(recorder, "draft", "build"):
            self._build()

    def _build(self) -> None:
        seqs, k = self.seqs, self.k
        index = seqs.tail_index(1) + torch.arange(k + 1, device=seqs.tokens.device)[None, :]  # [B, k+1]
        request = tree.GlueRequest(
            ids=torch.cat([seqs.gather(index[:, :1]), self.current.tokens], dim=1), index=index,
            positions=seqs.positions(index), fan_out=self.fan_out, temperature=self.temperature,
            saguaro_c=float(self.config.saguaro_c))
        self.cache = tree.build_speculations(self.draft, self.store, request, self.generator, self.build_nodes)
        if self.planner is not None:
            depths = self.cache.depth_s
            self.planner.measured.observe_build(sum(self.fan_out), self.cache.glue_s,
                                 sum(depths) / len(depths) if depths else None)

    def match(self, accepted: torch.Tensor, outcome: torch.Tensor, verify_s: float) -> Lookup:
        """Commit the outcome ``(a [B], r' [B])`` and look it up in the cache the last build made."""
        with traced(self.draft.recorder, "draft", "match"):
            return self._match(accepted, outcome, verify_s)

    def _match(self, accepted: torch.Tensor, outcome: torch.Tensor, verify_s: float) -> Lookup:
        seqs = self.seqs
        self._learn(accepted, outcome, seqs.active.clone(), verify_s)
        seqs.append(outcome_tokens(self.current.tokens, accepted, outcome), accepted + 1)
        self.store.invalidate_from(seqs.lengths - 1)  # keep r .. x_a of the glue, drop the rest
        hit, branch = self.cache.match(accepted, outcome)
        hit &= seqs.active
        tokens, probs = self.cache.speculation(branch)
        if self.temperature == 0.0:
            probs = None  # greedy verification needs no proposal distribution
        self.current = Speculation(tokens, probs, torch.where(hit, HIT, 0))
        return Lookup(hit, self.current)

    def fallback(self, missed: torch.Tensor) -> Speculation:
        """The next speculation with the rows ``missed [B]`` (bool) made by the fallback the policy picks."""
        kind = self.policy.choose()
        with traced(self.draft.recorder, "draft", f"fallback ({kind})"):
            return self._fallback(missed, kind)

    def _fallback(self, missed: torch.Tensor, kind: str) -> Speculation:
        rows = missed.nonzero().flatten()  # [M]
        started = time.perf_counter()
        if kind == "neural":
            fb_tokens, fb_probs = neural_fallback(self.draft, self.store, self.seqs, rows, self.k, self.temperature,
                                                  self.generator)
            self.policy.neural_s.append(since(started))
            if self.planner is not None:
                self.planner.measured.observe_step(self.policy.neural_s[-1] / self.k)
        else:
            fb_tokens, fb_probs = fast_fallback(self.seqs, rows, self.k, self.vocab, self.temperature)
        tokens, probs, source = self.current.tokens.clone(), self.current.probs, self.current.source.clone()
        tokens[rows] = fb_tokens
        if probs is not None:
            probs = probs.clone()
            probs[rows] = fb_probs
        source[rows] = SOURCES.index(kind)
        self.current = Speculation(tokens, probs, source, kind)
        return self.current

    def warm_up(self, spec: GenerateSpec, first_tokens: torch.Tensor):
        """Call every stage at every shape a generation like ``spec`` may use (each tree the planner may
        choose; the neural fallback for all ``B`` rows, one and ``B − 1``: after two sizes a compiling
        backend compiles the batch dimension dynamically) on a throwaway generation, so that a compiling
        backend compiles them now, not inside the rounds; then, for the planner, time each of them once
        more. Returns the measured :class:`~saguaro.runtime.draft.planner.StageCosts` (None without a
        planner). The next :meth:`open` starts afresh."""
        self.open(spec)
        self.start(first_tokens)
        budgets = self.planner.budgets if self.planner is not None else [None]
        rows = torch.arange(self.seqs.batch, device=first_tokens.device)
        for missed in sorted({1, self.seqs.batch - 1} - {0}):  # the full batch already ran in start()
            neural_fallback(self.draft, self.store, self.seqs, rows[:missed], self.k, self.temperature, self.generator)
        for budget in budgets:
            self.build_budget(budget)
        if self.planner is None:
            return None
        self.planner.costs = StageCosts()  # what compiled above is not a cost
        for _ in range(2):
            for budget in budgets:
                self.build_budget(budget)
            started = time.perf_counter()
            neural_fallback(self.draft, self.store, self.seqs, rows, self.k, self.temperature, self.generator)
            self.planner.costs.observe_step(since(started) / self.k)
        return self.planner.costs

    def build_budget(self, budget: int | None) -> None:
        """:meth:`build` with a tree of ``budget`` branches (None: the configured fan-out)."""
        if budget is None:
            return self.build(self._fixed_fan_out())
        cap = self.draft.width
        fan = geometric_fan_out(0.7, 1.0, self.k, min(budget, (self.k + 1) * cap), cap) if budget else None
        return self.build(fan or [0] * (self.k + 1))

    def _fixed_fan_out(self) -> list:
        return resolve_fan_out(self.config.fan_out, self.k, self.config.budget, self.estimator, self.draft.width)

    def _new_planner(self) -> Planner | None:
        """For ``fan_out="auto"``: a planner over the multiples of ``k+1`` up to the budget (and 0)."""
        if self.config.fan_out != "auto":
            return None
        budgets = list(range(0, self.config.budget + 1, self.k + 1)) + [self.config.budget]
        return Planner(self.k, budgets, self.draft.width)

    def trace_start(self) -> None:
        """Record this side's stage calls and methods (in the draft process: on its own recorder)."""
        self.draft.recorder = TraceRecorder("saguaro draft lane")

    def trace_take(self) -> dict | None:
        """The events recorded since :meth:`trace_start` (``TraceRecorder.take``); recording stops."""
        recorder, self.draft.recorder = self.draft.recorder, None
        return recorder.take() if recorder is not None else None

    def finished(self) -> bool:
        return self.seqs.all_finished()

    def _learn(self, accepted, outcome, active, verify_s) -> None:
        """Online α, ρ and the fallback policy's accepted lengths by source."""
        ranks = ranks_from_ranked(self.cache.ranked, accepted, outcome)
        self.estimator.observe(accepted[active], ranks[active])
        self.policy.verify_s.append(verify_s)
        if self.planner is not None:
            self.planner.measured.observe_verify(sum(self.fan_out), verify_s)
        for code, name in enumerate(SOURCES):
            rows = active & (self.current.source == code)
            if name in self.policy.accepted and bool(rows.any()):
                self.policy.accepted[name].extend((accepted[rows] + 1).tolist())
