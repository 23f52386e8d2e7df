"""The Program: the runtime of a compiled target/draft pair, modes ``ar``/``sd``/``ssd`` over the same
stages. ``saguaro.compile`` builds it from two :class:`ModelRunner` s, the lowering's shape policy
and the recipe of a remote draft; the Program never imports the passes or the lowering."""

from __future__ import annotations

import logging
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch

from saguaro.core.config import SaguaroConfig
from saguaro.core.errors import SaguaroError
from saguaro.core.schedule import critical_path, expected_overlap, round_schedule
from saguaro.core.stages import ROUND_STAGES, TARGET_SCORE, TARGET_VERIFY_LOGITS, stages_for
from saguaro.runtime.base.inputs import checked_controls, validate_call
from saguaro.runtime.base.model_runner import ModelRunner
from saguaro.runtime.base.prefix_cache import PrefixCache
from saguaro.runtime.base.sequences import SequenceBatch
from saguaro.runtime.base.state import DecodeState
from saguaro.runtime.base.stats import Counters, seconds_since, summarize
from saguaro.runtime.base.trace import GenerationTrace
from saguaro.runtime.calibration import Calibration
from saguaro.runtime.decode import DECODERS
from saguaro.runtime.decode.prefill import prefill
from saguaro.runtime.draft.server import GenerateSpec
from saguaro.runtime.generation_plan import GenerationPlan, grammar_plan, plan_call, plan_stats
from saguaro.runtime.lanes.owner import LaneOwner
from saguaro.runtime.scoring import ScoreOutput, score
from saguaro.runtime.streaming import TokenStream, check_not_reading, first_round_tells, streaming

log = logging.getLogger(__name__)
STAGE_OPTIONS = {
    "k",
    "backend",
    "compile",
    "attention",
    "linears",
    "narrow_weights",
    "draft_device",
    "cuda_graphs",
}


@dataclass
class GenerateOutput:
    """``sequences [B, T + new]``, a dict of ``stats`` and the raw ``counters`` they were made from."""

    sequences: torch.Tensor
    stats: dict
    counters: Counters | None = None
    trace: dict | None = None  # Chrome trace-event JSON object when generate(trace=...) recorded one


class Program:
    """A compiled pair: ``generate`` decodes in the configured mode, ``mode=`` overrides it per call.

    Thread-safe: calls are served one at a time, in no set order, under one lock shared with the Programs
    ``reconfigure`` and ``variant`` derive from it (they share its compiled stages).
    """

    # the decoder of each mode; runtime.decode.reference.reference_decoders(config): the reference rounds
    decoders: dict = DECODERS
    prefix_cache: PrefixCache | None = None  # cache_prefixes(); each Program (and variant) its own

    def __init__(
        self,
        config: SaguaroConfig,
        target: ModelRunner,
        draft: ModelRunner | None,
        pad_token_id: int,
        eos_token_id,
        shapes,
        remote_draft=None,
        exporter=None,
        lock=None,
    ):
        self.config = config
        self.target = target
        self.draft = draft
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.shapes = shapes  # the lowering's ShapePolicy: prompt padding and KV capacity buckets
        self.remote_draft = remote_draft  # what a process lane rebuilds the draft side from
        self.exporter = exporter  # writes this program's artifact (saguaro.compile sets it; see export)
        remote = config.lane == "remote"  # the draft may live only on the server (draft=None)
        self.lanes = LaneOwner(config, draft, remote_draft) if draft is not None or remote else None
        self._variants: dict = {}
        self.calibration = Calibration(target, draft, config.k)
        # batch sessions' measured speculation lengths, one per kind of round (runtime/batching.py)
        self.speculation_lengths: dict = {}
        self._lock = lock if lock is not None else threading.Lock()

    @property
    def lane_kind(self) -> str:
        """The lane SSD uses (see :func:`saguaro.runtime.lanes.owner.lane_kind`)."""
        return self.lanes.kind if self.lanes is not None else "thread"

    def variant(self, **changes) -> Program:
        """Like :meth:`reconfigure`, but kept: the same changes give the same Program (and draft lane)."""
        key = tuple(sorted((k, repr(v)) for k, v in changes.items()))
        with self._lock:
            if key not in self._variants:
                self._variants[key] = self.reconfigure(**changes)
            return self._variants[key]

    def reconfigure(self, **changes) -> Program:
        """A Program over the same stages with runtime options changed; ``ValueError`` for a
        :data:`STAGE_OPTIONS` one (it shapes the stages: compile again)."""
        if fixed := set(changes) & STAGE_OPTIONS:
            raise ValueError(f"{sorted(fixed)} cannot change after compile; call saguaro.compile again")
        return Program(
            replace(self.config, **changes),
            self.target,
            self.draft,
            self.pad_token_id,
            self.eos_token_id,
            self.shapes,
            self.remote_draft,
            self.exporter,
            self._lock,
        )

    def export(self, path, **options):
        """Write this program to the directory ``path`` for ``saguaro.load``; ``options``: those of
        :func:`~saguaro.artifact.export.export_program`. ``SaguaroError`` for a loaded program."""
        if self.exporter is None:
            raise SaguaroError(
                "this program cannot be exported: it was not made by saguaro.compile (a loaded "
                "program holds no captured graphs); export the compiled program"
            )
        return self.exporter(self, path, **options)

    def close(self) -> None:
        """Stop the draft lanes and background compiles of this program and its variants; a later call starts
        them again (and retries a lane that could not start)."""
        check_not_reading(self._lock)
        with self._lock:
            self._close()

    def _close(self) -> None:
        for variant in self._variants.values():
            variant._close()
        if self.lanes is not None:
            self.lanes.close()
        self.target.stop_compiling()  # one compile thread serves the target and the draft

    def compile_blocking(self) -> None:
        """Turn ``compile="background"`` blocking: wait for the queued compiles, then compile each new stage
        or shape on the calling thread before it runs."""
        for runner in filter(None, (self.target, self.draft)):
            runner.compile_blocking()
        with self._lock:
            for program in (self, *self._variants.values()):
                program.config = replace(program.config, compile="blocking")

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait for the queued background compiles: True once done, False after ``timeout`` seconds."""
        return all(
            runner.wait_compiled(timeout) for runner in (self.target, self.draft) if runner is not None
        )

    @property
    def max_length(self) -> int:
        """Longest prompt + new tokens allowed: the KV capacity and the models' maximum positions."""
        limits = [self.target.spec.max_positions]
        if self.draft is not None:
            limits.append(self.draft.spec.max_positions)
        elif self.lanes is not None:  # a remote draft only: its limit as the server described it
            limits.append(self.remote_draft.max_positions)
        if self.config.max_seq_len is not None:
            limits.append(self.config.max_seq_len)
        return min(limits)

    @property
    def draft_width(self) -> int:
        """The draft's fork / rank width (the server's, for a remote draft only)."""
        return self.draft.width if self.draft is not None else self.remote_draft.width

    @property
    def without_lane(self) -> str:
        """What SSD runs when no lane serves it: SD, or AR where the only draft is remote."""
        return "sd" if self.draft is not None else "ar"

    @property
    def max_branches(self) -> int:
        """The largest ``MQ`` any round may use."""
        f = self.config.fan_out
        if f in ("auto", "geometric"):
            return self.config.budget
        return (self.config.k + 1) * f if isinstance(f, int) else sum(f)

    def _store_capacity(self, prompt_len: int, max_new_tokens: int, tree: bool = False) -> int:
        # the last round may speculate k tokens past the budget, and r sits one slot after them
        capacity = prompt_len + max_new_tokens + self.config.k + 2
        if tree:  # SSD's draft store: tree scratch, k depths of at most MQ branches after the glue
            capacity += self.config.k * self.max_branches
        return self.shapes.capacity(capacity)

    def generate(
        self,
        input_ids,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        eos_token_id="default",
        seed: int | None = None,
        attention_mask=None,
        mode: str | None = None,
        trace=None,
        streamer=None,
        on_round=None,
        plan: GenerationPlan | None = None,
        controls=None,
    ) -> GenerateOutput:
        """Decode ``max_new_tokens`` after ``input_ids [B, T]`` (left-padded per ``attention_mask``).

        ``mode``: None for the configured one. ``seed=None`` draws the seed from torch's global generator,
        advancing it. ``trace``: a path, or True, for a Chrome trace in ``out.trace``. ``streamer``: a
        ``transformers`` streamer (batch 1). ``on_round``: called with each ``RoundTokens``. ``plan``: what
        :meth:`plan` made for this very call (else ``ValueError``). ``controls``: ``SamplingControls`` every
        token is decided under, exactly in every mode. Returns a :class:`GenerateOutput`; each argument in
        full: docs/api.md, ``program.generate``."""
        check_not_reading(self._lock)  # raises inside this Program's stream loop, which holds the lock
        with streaming(streamer, on_round, input_ids) as emitter, self._lock:
            return self._generate(
                input_ids,
                max_new_tokens,
                temperature,
                eos_token_id,
                seed,
                attention_mask,
                mode,
                trace,
                emitter,
                plan,
                controls,
            )

    def plan(
        self,
        input_ids,
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        eos_token_id="default",
        seed: int | None = None,
        attention_mask=None,
        mode: str | None = None,
    ) -> GenerationPlan:
        """What ``generate`` with these arguments runs (SSD: the lane warmed up, the verdict taken, counted);
        ``generate(..., plan=it)`` runs exactly that. ``ValueError`` for a sampled call without ``seed``."""
        if temperature > 0 and seed is None:
            raise ValueError("plan() of a sampled call needs its seed (temperature > 0, seed=None)")
        with self._lock, torch.inference_mode():
            mode, ids, mask, eos_ids = validate_call(
                self, input_ids, max_new_tokens, temperature, eos_token_id, seed, attention_mask, mode
            )
            padded_ids, padded_mask = self.shapes.pad_prompt(ids, mask, self.pad_token_id)
            call = (padded_ids, padded_mask, max_new_tokens, eos_ids, temperature)
            return replace(plan_call(self, mode, call, seed), made_for=_call_key(mode, call, seed))

    def score(self, input_ids, attention_mask=None, top: int = 0) -> ScoreOutput:
        """The target's log-probabilities of ``input_ids [B, T]``'s tokens and the ``top`` likeliest at each
        position: :func:`saguaro.runtime.scoring.score` (contract and errors), under the Program's lock."""
        check_not_reading(self._lock)
        with self._lock, torch.inference_mode():
            return score(self, input_ids, attention_mask, top)

    @property
    def can_score(self) -> bool:
        """Whether :meth:`score` can run: the target's builder offers its stage (a loaded one does not)."""
        return self.target.provides(TARGET_SCORE)

    def cache_prefixes(self, max_tokens: int | None) -> None:
        """Reuse the KV of earlier one-row prompts for a prompt that starts with the same tokens, holding up to
        ``max_tokens`` prompt positions (None or 0: off, the cache dropped). ``ValueError`` for a negative or
        non-integer count. Greedy outputs stay those of the prefill without it up to float rounding of the
        rows prefilled after a reused prefix (``runtime/base/prefix_cache.py``)."""
        if max_tokens is None or max_tokens == 0:
            self.prefix_cache = None
        else:
            self.prefix_cache = PrefixCache(max_tokens)

    @property
    def can_control(self) -> bool:
        """Whether ``generate(controls=...)`` can run in this program's mode: AR decides on the host, SD's and
        SSD's rounds need the target's ``target.verify_logits`` stage (a loaded artifact has none)."""
        return self.config.mode == "ar" or self.target.provides(TARGET_VERIFY_LOGITS)

    def stream(self, input_ids, **options) -> TokenStream:
        """:meth:`generate` (the same arguments) as an iterator of each round's ``RoundTokens``; ``.output``
        is generate's result once it has ended (:mod:`saguaro.runtime.streaming`)."""
        return TokenStream(self, input_ids, options, self._lock)

    @torch.inference_mode()
    def _generate(
        self,
        input_ids,
        max_new_tokens,
        temperature,
        eos_token_id,
        seed,
        attention_mask,
        mode,
        trace,
        on_round=None,
        plan=None,
        controls=None,
    ):
        mode, input_ids, attention_mask, eos_ids = validate_call(
            self, input_ids, max_new_tokens, temperature, eos_token_id, seed, attention_mask, mode
        )
        B, T = input_ids.shape
        controls = checked_controls(controls, self.target.spec.vocab_size)
        if controls is not None and mode != "ar" and self.target.provides(TARGET_VERIFY_LOGITS):
            self.target.stage(TARGET_VERIFY_LOGITS)  # built here, before a lane runs beside the rounds
        padded_ids, padded_mask = self.shapes.pad_prompt(input_ids, attention_mask, self.pad_token_id)
        generator, base = None, None
        if temperature > 0:  # one generator per lane (the draft lane's is seeded base + 1)
            base = seed if seed is not None else int(torch.randint(2**62, (), dtype=torch.long, device="cpu"))
            generator = torch.Generator(device=self.target.spec.device).manual_seed(base)
        # before the trace and the clock start: a new shape warms the lane up (and SD's, warm_sd_shapes)
        call = (padded_ids, padded_mask, max_new_tokens, eos_ids, temperature)
        if controls is not None and controls.grammar is not None:  # SSD's lane cannot carry it: SD's rounds
            plan = grammar_plan(self, mode, plan, temperature, _call_key(mode, call, base))
        if plan is None:
            plan = plan_call(self, mode, call, base)
        elif plan.made_for != _call_key(mode, call, base):
            raise ValueError(
                "plan= was made by plan() for another call (mode, prompt, mask, max_new_tokens, "
                "temperature, seed or eos_token_id differ): plan this call, or leave plan=None"
            )
        runners = [self.target] + ([self.draft] if plan.run == "sd" else [])
        with GenerationTrace(trace, runners, plan.lane if plan.run == "ssd" else None) as tracing:
            start = time.perf_counter()
            state = self._decode(
                plan,
                padded_ids,
                padded_mask,
                max_new_tokens,
                eos_ids,
                temperature,
                generator,
                tracing.recorder,
                first_round_tells(runners, on_round),
                controls=controls,
            )
            # less the time a streaming reader held the rounds
            wall = seconds_since(start) - state.counters.stream_s
        sequences = state.seqs.result()[:, padded_ids.shape[1] - T :]  # without the bucket's padding columns
        new_tokens = sum(state.seqs.host_lengths) - B * state.seqs.prompt_len  # the host view: no read
        stats = summarize(
            state.counters,
            plan.mode,
            new_tokens,
            B,
            wall,
            self.lane_kind,
            self._schedule_stats(temperature > 0) if plan.mode == "ssd" else None,
        )
        stats |= plan_stats(plan, (self.target, self.draft))  # ran_as "sd" in mode "ssd": planned SD
        if plan.mode == "ssd":
            stats["planned_sd"] = plan.planned_sd  # True: the planner measured that no tree pays here, SD ran
            if plan.run == "ssd" and not state.counters.lane_failures:
                self.calibration.record_ssd(
                    self.calibration.verdict_key(plan.lane, plan.spec),
                    state.counters.round_s,
                    plan.sd_round_s,
                )
        return GenerateOutput(
            sequences=sequences, stats=stats, counters=state.counters, trace=tracing.finish(stats)
        )

    def _draft_spec(
        self, padded_ids, padded_mask, max_new_tokens, eos_ids, temperature, base
    ) -> GenerateSpec:
        capacity = self._store_capacity(padded_ids.shape[1], max_new_tokens, tree=True)
        return GenerateSpec(
            padded_ids,
            padded_mask,
            max_new_tokens,
            capacity,
            eos_ids,
            self.pad_token_id,
            float(temperature),
            None if base is None else base + 1,
        )

    def _decode(
        self,
        plan: GenerationPlan,
        padded_ids,
        padded_mask,
        max_new_tokens,
        eos_ids,
        temperature,
        generator,
        recorder,
        on_round=None,
        *,
        controls=None,
    ) -> DecodeState:
        B = padded_ids.shape[0]
        # the target's store never holds a tree, nor does the draft's of SD rounds: an SSD generation run as
        # SD has SD's shapes, its draft steps attending over SD's slots only, not SSD's tree scratch too
        capacity = self._store_capacity(padded_ids.shape[1], max_new_tokens)
        pool = self.target.seq_pool
        seqs = SequenceBatch(
            padded_ids, padded_mask, max_new_tokens, capacity, eos_ids, self.pad_token_id, pool
        )
        state = DecodeState(
            seqs=seqs,
            target_store=self.target.new_store(B, capacity),
            draft_store=self.draft.new_store(B, capacity) if plan.run == "sd" else None,
            temperature=float(temperature),
            generator=generator,
            k=self.config.k,
            recorder=recorder,
            on_round=on_round,
            controls=controls,
            prefix_cache=self.prefix_cache,
        )
        if plan.calibrated is not None:  # SSD's ideal round: the verify alone (also for SSD run as SD)
            state.counters.verify_alone_s = plan.calibrated[0]
        ssd = plan.run == "ssd"
        lane_context = self.lanes.ssd_context(self.target.spec.device) if ssd else nullcontext()
        with lane_context:  # a priority stream on GPU
            first = prefill(self.target, self.draft, state)
            self.decoders[plan.run](self.target, self.draft, state, plan, first)
        if ssd and state.counters.lane_failures:
            self.lanes.drop()  # a lane that failed mid-generation is not reused
        return state

    @property
    def schedule(self):
        """The round DAG of the configured mode (``networkx.DiGraph``), costed with measured stage times."""
        return self.round_schedule(self.config.mode, sampled=False)

    def round_schedule(self, mode: str, sampled: bool):
        costs = dict(self.target.stage_cost_s) | (
            dict(self.draft.stage_cost_s) if self.draft is not None else {}
        )
        return round_schedule(mode, self.config.k, sampled=sampled, costs=costs)

    def runner(self, model: str) -> ModelRunner:
        """The runner of ``"target"`` or ``"draft"``."""
        return self.target if model == "target" else self.draft

    def prepare(self, mode: str, temperature: float) -> None:
        """Build (and lower) every stage ``mode`` needs now, on the caller's thread: stage building
        traces with ``torch.fx``, which must not overlap a lane running graphs."""
        for stage in stages_for(mode, temperature):
            runner = self.runner(stage.model)  # None: a remote draft builds its own
            if runner is not None:  # a round stage the builder does not offer: the stage run instead
                runner.stage(stage if runner.provides(stage) else ROUND_STAGES.get(stage, stage))

    def _schedule_stats(self, sampled: bool) -> dict:
        """Critical path and expected overlap of the SSD round DAG, costed with the measured stage times."""
        g = self.round_schedule("ssd", sampled)
        path, length = critical_path(g)
        return {
            "critical_path": path,
            "critical_path_ms": 1000 * length,
            "expected_overlap": expected_overlap(g),
        }


def _call_key(mode: str, call: tuple, base) -> tuple:
    """What ``generate(plan=...)`` checks: ``mode``, seed ``base`` and every argument in ``call``."""
    padded_ids, padded_mask, max_new_tokens, eos_ids, temperature = call
    return (
        mode,
        tuple(padded_ids.shape),
        tuple(padded_ids.flatten().tolist()),
        tuple(padded_mask.flatten().tolist()),
        max_new_tokens,
        tuple(eos_ids),
        float(temperature),
        base,
    )
