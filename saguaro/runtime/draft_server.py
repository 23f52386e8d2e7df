"""The draft side of SSD: everything the draft lane owns, behind five methods.

``open`` prefills the draft on the prompt; ``start`` takes the target's first token and decodes the
first speculation; ``build`` runs glue, fork and tree decode for the speculation now under
verification (this is what overlaps the target); ``match`` takes the outcome ``(a, r')``, commits it
and looks it up in the speculation cache; ``fallback`` makes the next speculation of the rows that
missed. The server keeps its own mirror of the sequences, so a lane can run it unchanged on a worker
thread or in another process: a lane only ever calls these methods by name with tensor arguments.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from saguaro.core.config import SaguaroConfig
from saguaro.core.schedule import build_steps, round_schedule
from saguaro.core.stages import DRAFT_PREFILL
from saguaro.runtime import tree
from saguaro.runtime.fallback import FallbackPolicy, fast_fallback, neural_fallback
from saguaro.runtime.fan_out import OutcomeEstimator, resolve_fan_out
from saguaro.runtime.model_runner import ModelRunner
from saguaro.runtime.sequences import SequenceBatch
from saguaro.runtime.stats import SOURCES, since
from saguaro.runtime.trace import TraceRecorder, traced
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
        self.policy = FallbackPolicy(self.config.fallback, self.seqs.batch)
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

    def build(self) -> None:
        """Glue, fork and tree decode for the speculation under verification (overlaps the target)."""
        seqs, k = self.seqs, self.k
        self.fan_out = resolve_fan_out(self.config.fan_out, k, self.config.budget, self.estimator, self.draft.width)
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
        for code, name in enumerate(SOURCES):
            rows = active & (self.current.source == code)
            if name in self.policy.accepted and bool(rows.any()):
                self.policy.accepted[name].extend((accepted[rows] + 1).tolist())
