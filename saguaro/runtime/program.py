"""The Program: runtime of a compiled target/draft pair. Modes ``ar``/``sd`` over the same stages."""

from __future__ import annotations

import logging
import time
import warnings
import weakref
from dataclasses import dataclass, replace

import torch

from saguaro.config import MODES, SaguaroConfig
from saguaro.runtime.decode_ar import decode_ar
from saguaro.runtime.decode_sd import decode_sd
from saguaro.runtime.decode_ssd import decode_ssd
from saguaro.runtime.draft_server import GenerateSpec, SpeculationServer
from saguaro.runtime.lanes import DraftLaneError, ThreadLane, one_thread_per_lane
from saguaro.runtime.inputs import check_generate_args
from saguaro.runtime.model_runner import ModelRunner
from saguaro.runtime.sequences import SequenceBatch
from saguaro.runtime.state import DecodeState
from saguaro.runtime.verification import sample_tokens
from saguaro.lower import CAPACITY_BUCKET, PROMPT_BUCKET, bucketed
from saguaro.schedule import critical_path, expected_overlap, round_schedule

log = logging.getLogger(__name__)


@dataclass
class GenerateOutput:
    """``sequences [B, T + new]`` and a dict of ``stats``."""

    sequences: torch.Tensor
    stats: dict


class Program:
    """A compiled pair. ``generate`` decodes in the configured mode; ``mode=`` overrides it per call."""

    def __init__(self, config: SaguaroConfig, target: ModelRunner, draft: ModelRunner | None,
                 pad_token_id: int, eos_token_id, draft_model: torch.nn.Module | None = None):
        self.config = config
        self.target = target
        self.draft = draft
        self.draft_model = draft_model  # what a process lane captures again on its side
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self._lane = None
        self._variants: dict = {}

    def _draft_lane(self):
        """The SSD draft lane of this program, started on first use and kept."""
        if self._lane is None:
            if self.lane_kind == "process":
                from saguaro.runtime.process_lane import ProcessLane

                self._lane = ProcessLane(self.draft_model, self.config, self.draft.spec.vocab_size,
                                         self.config.lane_timeout_s)
            else:
                self._lane = ThreadLane(SpeculationServer(self.draft, self.config), self.target.spec.device,
                                        self.config.lane_timeout_s)
            self._finalizer = weakref.finalize(self, self._lane.close)
        return self._lane

    def variant(self, **changes) -> "Program":
        """Like :meth:`reconfigure`, but kept: the same changes give the same Program (and draft lane)."""
        key = tuple(sorted((k, repr(v)) for k, v in changes.items()))
        if key not in self._variants:
            self._variants[key] = self.reconfigure(**changes)
        return self._variants[key]

    @property
    def lane_kind(self) -> str:
        """The lane SSD uses: the configured one, or for ``"auto"`` the process lane for the eager backend
        on CPU and the thread lane otherwise (see :class:`~saguaro.config.SaguaroConfig`)."""
        if self.config.lane != "auto":
            return self.config.lane
        eager_on_cpu = self.target.spec.device.type == "cpu" and self.config.backend == "eager"
        return "process" if eager_on_cpu else "thread"

    def close(self) -> None:
        """Stop the draft lane (thread or process) of this program and of its variants. A program
        starts a new lane if used again."""
        for variant in self._variants.values():
            variant.close()
        if self._lane is not None:
            self._finalizer()
            self._lane = None
    def reconfigure(self, **changes) -> "Program":
        """A Program over the same captured and lowered stages with some options changed.

        Only runtime options may change (mode, fallback, fan-out, saguaro_c, lane timeout); ``k``,
        ``backend`` and ``attention`` shape what was compiled.
        """
        fixed = {"k", "backend", "attention"} & set(changes)
        if fixed:
            raise ValueError(f"{sorted(fixed)} cannot change after compile; call saguaro.compile again")
        return Program(replace(self.config, **changes), self.target, self.draft, self.pad_token_id,
                       self.eos_token_id, self.draft_model)

    @property
    def max_length(self) -> int:
        """Longest prompt + new tokens allowed: the KV capacity and the models' maximum positions."""
        limits = [self.target.spec.max_positions]
        if self.draft is not None:
            limits.append(self.draft.spec.max_positions)
        if self.config.max_seq_len is not None:
            limits.append(self.config.max_seq_len)
        return min(limits)

    def _store_capacity(self, prompt_len: int, max_new_tokens: int, mode: str) -> int:
        # the last round may speculate k tokens past the budget, and r sits one slot after them
        capacity = prompt_len + max_new_tokens + self.config.k + 2
        if mode == "ssd":  # tree scratch: k depths of at most MQ branches after the glue
            capacity += self.config.k * self.max_branches
        if self.config.backend == "inductor":  # one static shape per bucket, not per request
            capacity = bucketed(capacity, CAPACITY_BUCKET)
        return capacity

    def _pad_to_bucket(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        """For inductor, left-pad the prompt to a multiple of :data:`~saguaro.lower.PROMPT_BUCKET` columns
        (masked, so the tokens are unchanged; the columns are dropped from the result): prompts of
        nearby lengths then share the prefill's static shapes."""
        T = input_ids.shape[1]
        if self.config.backend != "inductor" or T % PROMPT_BUCKET == 0:
            return input_ids, attention_mask
        extra = bucketed(T, PROMPT_BUCKET) - T
        pad = input_ids.new_full((input_ids.shape[0], extra), self.pad_token_id)
        return torch.cat([pad, input_ids], dim=1), torch.cat([torch.zeros_like(pad), attention_mask], dim=1)

    @property
    def max_branches(self) -> int:
        """The largest ``MQ`` any round may use."""
        f = self.config.fan_out
        if f == "geometric":
            return self.config.budget
        return (self.config.k + 1) * f if isinstance(f, int) else sum(f)

    @torch.inference_mode()
    def generate(self, input_ids, max_new_tokens: int = 32, temperature: float = 0.0, eos_token_id="default",
                 seed: int | None = None, attention_mask=None, mode: str | None = None) -> GenerateOutput:
        mode = mode or self.config.mode
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is not allowed: choose one of {', '.join(MODES)}")
        if mode != "ar" and self.draft is None:
            raise ValueError(f"mode={mode!r} needs a draft model; compile with draft=... or use mode='ar'")
        if eos_token_id == "default":
            eos_token_id = self.eos_token_id
        device = self.target.spec.device
        input_ids, attention_mask, eos_ids = check_generate_args(
            input_ids, attention_mask, max_new_tokens, temperature, seed, eos_token_id, device)
        vocab = self.target.spec.vocab_size
        if bool(((input_ids < 0) | (input_ids >= vocab)).any()):
            raise ValueError(f"input_ids hold token ids outside the vocabulary [0, {vocab})")
        B, T = input_ids.shape
        if T + max_new_tokens > self.max_length:
            raise ValueError(
                f"prompt length {T} + max_new_tokens {max_new_tokens} = {T + max_new_tokens} exceeds the maximum "
                f"of {self.max_length} tokens (KV capacity / the models' max_position_embeddings)")
        user_ids, user_mask = input_ids, attention_mask
        input_ids, attention_mask = self._pad_to_bucket(input_ids, attention_mask)
        extra_columns = input_ids.shape[1] - T
        generator, base = None, None
        if temperature > 0:  # one generator per lane (the draft lane's is seeded base + 1)
            base = seed if seed is not None else int(torch.seed() % (2**62))
            generator = torch.Generator(device=device).manual_seed(base)

        self.prepare(mode, temperature)
        start = time.perf_counter()
        capacity = self._store_capacity(input_ids.shape[1], max_new_tokens, mode)
        seqs = SequenceBatch(input_ids, attention_mask, max_new_tokens, capacity, eos_ids, self.pad_token_id)
        state = DecodeState(
            seqs=seqs,
            target_store=self.target.new_store(B, capacity),
            draft_store=self.draft.new_store(B, capacity) if mode == "sd" else None,
            temperature=float(temperature), generator=generator, k=self.config.k,
        )
        if mode == "ssd":
            try:
                lane = self._draft_lane()
            except DraftLaneError as exc:  # no lane could start: SD gives the same tokens
                warnings.warn(f"saguaro: {exc}; generating with SD instead (output stays exact)", RuntimeWarning,
                              stacklevel=2)
                return self.generate(user_ids, max_new_tokens, temperature, eos_token_id=eos_ids, seed=seed,
                                     attention_mask=user_mask, mode="sd")
            with one_thread_per_lane(device):
                first = self._prefill(state)
                draft_spec = GenerateSpec(input_ids, attention_mask, max_new_tokens, capacity, eos_ids,
                                          self.pad_token_id, float(temperature), None if base is None else base + 1)
                if not decode_ssd(self.target, self.draft, state, lane, draft_spec, first):
                    self.close()  # a failed lane is not reused
        else:
            self._prefill(state)
            if mode == "ar":
                decode_ar(self.target, state)
            else:
                decode_sd(self.target, self.draft, state)
        wall = time.perf_counter() - start
        sequences = seqs.result()[:, extra_columns:]  # without the bucket's padding columns
        return GenerateOutput(sequences=sequences, stats=self._stats(state, mode, wall))

    @property
    def schedule(self):
        """The round DAG of the configured mode (``networkx.DiGraph``), costed with measured stage times."""
        return self.round_schedule(self.config.mode, sampled=False)

    def round_schedule(self, mode: str, sampled: bool):
        costs = dict(self.target.stage_cost_s)
        if self.draft is not None:
            costs.update(self.draft.stage_cost_s)
        return round_schedule(mode, self.config.k, sampled=sampled, costs=costs)

    def stages_for(self, mode: str, temperature: float) -> dict:
        """The stages a generation in ``mode`` calls, per model."""
        kind = "greedy" if temperature == 0 else "sampled"
        target = ["prefill", "step"] if mode == "ar" else ["prefill", f"verify_{kind}"]
        draft = {"ar": [], "sd": ["prefill", f"step_{kind}"],
                 "ssd": ["prefill", f"step_{kind}", "glue", f"tree_{kind}"]}[mode]
        return {"target": target, "draft": draft}

    def prepare(self, mode: str, temperature: float) -> None:
        """Build (and lower) every stage ``mode`` needs now, on the caller's thread: stage building
        traces with ``torch.fx``, which must not overlap a lane running graphs."""
        for role, names in self.stages_for(mode, temperature).items():
            runner = self.target if role == "target" else self.draft
            for name in names:
                runner.stage(name)

    def _prefill(self, state: DecodeState) -> torch.Tensor:
        """Prefill both stores with the prompt and decide the first token from the target."""
        seqs = state.seqs
        T = seqs.prompt_len
        index = torch.arange(T, device=seqs.tokens.device).expand(seqs.batch, T)  # [B, T]
        ids, pos = seqs.tokens[:, :T], seqs.prompt_positions()
        with state.timers.time("prefill_s"):
            (logits,) = self.target.run("prefill", state.target_store, ids, pos, index)  # [B, V]
            if state.draft_store is not None:
                self.draft.run("prefill", state.draft_store, ids, pos, index)
        first, _ = sample_tokens(logits, state.temperature, state.generator)
        seqs.append(first[:, None], torch.ones_like(first))
        return first

    def _stats(self, state: DecodeState, mode: str, wall: float) -> dict:
        new_tokens = int(state.seqs.generated.sum())
        rounds = int(state.timers.counts.get("rounds", 0))
        lengths = state.accepted_lengths
        return {
            "mode": mode,
            "new_tokens": new_tokens,
            "wall_s": wall,
            "tokens_per_s": new_tokens / wall if wall > 0 else 0.0,
            "rounds": rounds,
            "mean_accepted_len": sum(lengths) / len(lengths) if lengths else 0.0,
            "prefill_s": state.timers.seconds.get("prefill_s", 0.0),
            "verify_s": state.timers.seconds.get("verify_s", 0.0),
            "draft_s": state.timers.seconds.get("draft_s", 0.0),
        } | (self._ssd_stats(state, wall) if mode == "ssd" else {})

    def _ssd_stats(self, state: DecodeState, wall: float) -> dict:
        c, s = state.timers.counts, state.timers.seconds
        lookups = c.get("lookups", 0)
        rounds = c.get("rounds", 0)
        new_tokens = int(state.seqs.generated.sum())
        lengths = state.accepted_lengths
        mean_len = sum(lengths) / len(lengths) if lengths else 0.0
        mean_verify = s.get("verify_s", 0.0) / rounds if rounds else 0.0
        ideal = mean_len * state.seqs.batch / mean_verify if mean_verify > 0 else 0.0
        per_source = {}
        for name in ("hit", "neural", "fast"):
            n = c.get(f"rounds_after_{name}", 0)
            per_source[name] = c.get(f"accepted_after_{name}", 0) / n if n else None
        return {
            "cache_hit_rate": c.get("hits", 0) / lookups if lookups else 0.0,
            "hits_by_position": {a: c.get(f"hits_at_{a}", 0) for a in range(self.config.k + 1)},
            "accepted_len_on_hits": per_source["hit"],
            "accepted_len_on_misses": _mean_of(c, ("neural", "fast")),
            "fallbacks": {"neural": c.get("fallback_neural", 0), "fast": c.get("fallback_fast", 0)},
            "draft_wait_s": s.get("draft_wait_s", 0.0),
            "fallback_s": s.get("fallback_neural_s", 0.0) + s.get("fallback_fast_s", 0.0),
            "overlap_efficiency": (new_tokens / wall) / ideal if ideal > 0 else 0.0,
            "lane_failures": c.get("lane_failures", 0),
            "lane": self.lane_kind,
            **self._schedule_stats(state.temperature > 0),
        }


    def _schedule_stats(self, sampled: bool) -> dict:
        """Critical path and expected overlap of the SSD round DAG, costed with this program's measured
        stage times (valid when the draft process lane measured nothing here: then default costs)."""
        g = self.round_schedule("ssd", sampled)
        path, length = critical_path(g)
        return {"critical_path": path, "critical_path_ms": 1000 * length, "expected_overlap": expected_overlap(g)}


def _mean_of(counts: dict, names) -> float | None:
    total = sum(counts.get(f"accepted_after_{n}", 0) for n in names)
    rounds = sum(counts.get(f"rounds_after_{n}", 0) for n in names)
    return total / rounds if rounds else None
