"""The draft side of SSD: everything the draft lane owns, behind the methods a lane calls by name:
``open`` prefills, ``start`` drafts the first speculation, ``build`` runs glue, fork and tree decode while
the target verifies, ``match`` commits the outcome ``(a, r')`` and looks it up, ``fallback`` drafts the
missed rows; :mod:`.rows` changes the batch. Outcomes and hits travel as host lists."""

from __future__ import annotations

import copy

import torch

from saguaro.core.config import SaguaroConfig
from saguaro.core.schedule import build_steps, round_schedule
from saguaro.core.stages import DRAFT_PREFILL
from saguaro.runtime.base.model_runner import ModelRunner
from saguaro.runtime.base.sequences import SequenceBatch, host_to_device
from saguaro.runtime.base.stats import SOURCES
from saguaro.runtime.base.timing import Stopwatch
from saguaro.runtime.base.trace import TraceRecorder, traced
from saguaro.runtime.draft import tree
from saguaro.runtime.draft.fallback import FallbackPolicy, fast_fallback, neural_fallback
from saguaro.runtime.draft.fan_out import OutcomeEstimator, geometric_fan_out, resolve_fan_out
from saguaro.runtime.draft.planner import Planner, StageCosts
from saguaro.runtime.draft.records import FAST, HIT, NEURAL, GenerateSpec, Lookup, Speculation
from saguaro.runtime.draft.rows import RowChanges
from saguaro.tensor_math.fork import ranks_from_ranked
from saguaro.tensor_math.verification import outcome_tokens

MAX_LAYOUTS = 64  # branch layouts (index tensors per fan-out) a server keeps on its device


class SpeculationServer(RowChanges):
    """Draft-side state of one generation, or of a running batch whose rows change between rounds."""

    def __init__(self, draft: ModelRunner, config: SaguaroConfig):
        self.draft = draft
        self.config = config
        self.k = config.k
        self.vocab = draft.spec.vocab_size
        self.device = draft.spec.device  # where the draft's stages run: the mirror and every index live here
        self._layouts: dict = {}  # fan-out -> its branch layout on the device (GlueRequest.layouts)

    def open(self, spec: GenerateSpec) -> None:
        with traced(self.draft.recorder, "draft", "open (prefill)"):
            self._open(spec)

    def _open(self, spec: GenerateSpec) -> None:
        device = self.device
        self.seqs = SequenceBatch(
            spec.input_ids.to(device),
            spec.attention_mask.to(device),
            spec.max_new_tokens,
            spec.capacity,
            spec.eos_token_ids,
            spec.pad_token_id,
        )
        self.store = None  # the last generation's store goes back to the KV pool before this one is made
        self.store = self.draft.new_store(self.seqs.batch, spec.capacity)
        self.temperature = spec.temperature
        self.generator = None
        if spec.temperature > 0:
            self.generator = torch.Generator(device=device).manual_seed(spec.seed)
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
        self.row_capacity = [spec.capacity] * self.seqs.batch  # the store slots each row needs (RowChanges)
        self._pending_ranks = None  # (accepted [B] host, ranks [B] device) of the last outcome, for ρ
        T = self.seqs.prompt_len
        index = torch.arange(T, device=device).expand(self.seqs.batch, T)
        self.draft.run(
            DRAFT_PREFILL, self.store, self.seqs.tokens[:, :T], self.seqs.prompt_positions(), index
        )

    def start(self, first_tokens: torch.Tensor) -> Speculation:
        """The target's first token ``[B]`` arrives: draft the first speculation."""
        with traced(self.draft.recorder, "draft", "start (first speculation)"):
            return self._start(first_tokens)

    def _start(self, first_tokens: torch.Tensor) -> Speculation:
        first_tokens = first_tokens.to(self.device)
        self.seqs.append(first_tokens[:, None], torch.ones_like(first_tokens))
        rows = torch.arange(self.seqs.batch, device=self.device)
        tokens, probs = neural_fallback(
            self.draft, self.store, self.seqs, rows, self.k, self.temperature, self.generator
        )
        self.current = Speculation(tokens, probs, [NEURAL] * self.seqs.batch)
        return self.current

    def build(self, fan_out: list | None = None) -> None:
        """Glue, fork and tree decode for the speculation under verification, with ``fan_out`` when given,
        else the planner's (or the configured one)."""
        if fan_out is not None:
            self.fan_out = list(fan_out)
        elif self.planner is not None:
            self.fan_out = self.planner.plan(
                self.estimator.alpha,
                self.estimator.miss_function(),
                self.policy.choose(),
                self.policy.mean_accepted("fast", 1.0),
            ).fan_out
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
        index = seqs.forward_index(k + 1)  # [B, k+1]
        if len(self._layouts) > MAX_LAYOUTS:
            self._layouts.clear()
        request = tree.GlueRequest(
            ids=torch.cat([seqs.gather(index[:, :1]), self.current.tokens], dim=1),
            index=index,
            positions=seqs.positions(index),
            fan_out=self.fan_out,
            temperature=self.temperature,
            saguaro_c=float(self.config.saguaro_c),
            layouts=self._layouts,
        )
        self.cache = tree.build_speculations(
            self.draft, self.store, request, self.generator, self.build_nodes
        )
        self._read_build()
        if self.planner is not None:
            depths = self.cache.depth_s
            self.planner.measured.observe_build(
                sum(self.fan_out), self.cache.glue_s, sum(depths) / len(depths) if depths else None
            )

    def match(self, accepted: list, outcome: list, verify_s: float) -> Lookup:
        """Commit the outcome ``(a [B], r' [B])``, host ints (``a`` None on inactive rows), and look it up
        in the last build's cache."""
        with traced(self.draft.recorder, "draft", "match"):
            return self._match(accepted, outcome, verify_s)

    def _match(self, accepted: list, outcome: list, verify_s: float) -> Lookup:
        seqs = self.seqs
        hit, branch = self.cache.match_host(accepted, outcome)  # host work: the build read its table
        counts = [0 if a is None else a for a in accepted]  # rows no longer active take nothing anyway
        host = torch.tensor([counts, outcome, branch], dtype=torch.long, device="cpu")  # [3, B]
        accepted_d, outcome_d, branch_d = host_to_device(host, self.device)  # one copy, no sync
        self._learn(accepted, accepted_d, outcome_d, verify_s)
        seqs.append(outcome_tokens(self.current.tokens, accepted_d, outcome_d), accepted_d + 1)
        self.store.invalidate_from(seqs.lengths - 1)  # keep r .. x_a of the glue, drop the rest
        tokens, probs = self.cache.speculation(branch_d)
        if self.temperature == 0.0:
            probs = None  # greedy verification needs no proposal distribution
        self.current = Speculation(tokens, probs, [HIT if h else NEURAL for h in hit])
        return Lookup(hit, self.current)

    def fallback(self, missed: list) -> Speculation:
        """The next speculation, the rows ``missed [B]`` (host bools) drafted by the policy's fallback."""
        kind = self.policy.choose()
        self.policy.took(kind)
        with traced(self.draft.recorder, "draft", f"fallback ({kind})"):
            return self._fallback(missed, kind)

    def _fallback(self, missed: list, kind: str) -> Speculation:
        missed_rows = [b for b, m in enumerate(missed) if m]
        rows = host_to_device(torch.tensor(missed_rows, dtype=torch.long, device="cpu"), self.device)  # [M]
        watch = Stopwatch(self.device)
        if kind == "neural":
            fb_tokens, fb_probs = neural_fallback(
                self.draft, self.store, self.seqs, rows, self.k, self.temperature, self.generator
            )
            for seconds in self.policy.time_neural(watch.stop()):  # device time once ready: never a wait
                if self.planner is not None:
                    self.planner.measured.observe_step(seconds / self.k)
        else:
            fb_tokens, fb_probs = fast_fallback(self.seqs, rows, self.k, self.vocab, self.temperature)
        tokens, probs, source = self.current.tokens.clone(), self.current.probs, list(self.current.source)
        tokens[rows] = fb_tokens
        if probs is not None:
            probs = probs.clone()
            probs[rows] = fb_probs
        for b in missed_rows:
            source[b] = SOURCES.index(kind)
        self.current = Speculation(tokens, probs, source, kind)
        return self.current

    def warm_up(self, spec: GenerateSpec, first_tokens: torch.Tensor):
        """Run every stage shape a generation like ``spec`` may use on a throwaway generation (each tree the
        planner may choose, the neural fallback for ``B``, 1, ``B − 1`` rows) so compiles happen now, then
        time each once: the ``StageCosts`` of each stage alone (None without a planner). ``open`` restarts."""
        self.open(spec)
        self.start(first_tokens)
        budgets = self.planner.budgets if self.planner is not None else [None]
        rows = torch.arange(self.seqs.batch, device=self.device)
        for missed in sorted({1, self.seqs.batch - 1} - {0}):  # the full batch already ran in start()
            neural_fallback(
                self.draft, self.store, self.seqs, rows[:missed], self.k, self.temperature, self.generator
            )
        for budget in budgets:
            self.build_budget(budget)
        if self.planner is None:
            return None
        self.planner.costs = StageCosts()  # what compiled above is not a cost
        for _ in range(2):
            for budget in budgets:
                self.build_budget(budget)
            watch = Stopwatch(self.device)
            neural_fallback(self.draft, self.store, self.seqs, rows, self.k, self.temperature, self.generator)
            self.planner.costs.observe_step(watch.stop().seconds / self.k)
        alone, self.planner.costs = self.planner.costs, StageCosts()  # the next builds run against the verify
        return alone

    def plan_costs(self) -> StageCosts | None:
        """What the builds since :meth:`warm_up` measured (calibration runs them against the verify)."""
        return self.planner.costs if self.planner is not None else None

    def build_budget(self, budget: int | None) -> None:
        """:meth:`build` with a tree of ``budget`` branches (None: the configured fan-out)."""
        if budget is None:
            return self.build(self._fixed_fan_out())
        cap = self.draft.width
        fan = geometric_fan_out(0.7, 1.0, self.k, min(budget, (self.k + 1) * cap), cap) if budget else None
        return self.build(fan or [0] * (self.k + 1))

    def _fixed_fan_out(self) -> list:
        return resolve_fan_out(
            self.config.fan_out, self.k, self.config.budget, self.estimator, self.draft.width
        )

    def _new_planner(self) -> Planner | None:
        """For ``fan_out="auto"``: a planner over 0, the multiples of ``k+1`` and the budget; else None."""
        auto = self.config.fan_out == "auto"
        return (
            Planner(
                self.k,
                list(range(0, self.config.budget + 1, self.k + 1)) + [self.config.budget],
                self.draft.width,
            )
            if auto
            else None
        )

    def trace_start(self) -> None:
        """Record this side's stage calls and methods on a recorder of its own."""
        self.draft.recorder = TraceRecorder("saguaro draft lane")

    def trace_take(self) -> dict | None:
        """The events recorded since :meth:`trace_start` (``TraceRecorder.take``); recording stops."""
        recorder, self.draft.recorder = self.draft.recorder, None
        return recorder.take() if recorder is not None else None

    def finished(self) -> bool:
        return self.seqs.all_finished()

    def _learn(
        self, accepted: list, accepted_d: torch.Tensor, outcome_d: torch.Tensor, verify_s: float
    ) -> None:
        """Online α (hits and neural rounds only), ρ and the policy's accepted lengths; the ranks ρ needs
        are computed on the device here and read with the next build (:meth:`_read_build`)."""
        # α from the draft's own speculations only (hits, neural): an n-gram proposal accepts less
        self.estimator.observe(
            [a for a, code in zip(accepted, self.current.source) if a is not None and code != FAST]
        )
        self._pending_ranks = (accepted, ranks_from_ranked(self.cache.ranked, accepted_d, outcome_d))  # [B]
        self.policy.observe_round([SOURCES[code] for code in self.current.source], accepted, verify_s)
        if self.planner is not None:
            self.planner.measured.observe_verify(sum(self.fan_out), verify_s)

    def _read_build(self) -> None:
        """The build's one device→host read, at its end: the candidate table ``[B, MQ]`` (so :meth:`match`
        is host work) and the last outcome's ranks."""
        cache, pending = self.cache, self._pending_ranks
        B, MQ = cache.candidates.shape
        parts = [cache.candidates.reshape(-1)] + ([pending[1]] if pending is not None else [])
        host = torch.cat(parts).tolist()  # [B * MQ (+ B)]
        rows = [j for j, f in enumerate(self.fan_out) for _ in range(f)]  # [MQ]: glue row of each branch
        cache.index_on_host(rows, [host[b * MQ : (b + 1) * MQ] for b in range(B)])
        if pending is not None:
            seen = [(a, r) for a, r in zip(pending[0], host[B * MQ :]) if a is not None]
            self.estimator.observe_ranks([a for a, _ in seen], [r for _, r in seen])
            self._pending_ranks = None
