"""The draft side of SSD: everything the draft lane owns, behind four calls.

``open`` prefills the draft on the prompt; ``start`` takes the target's first token and decodes the
first speculation; ``build`` runs glue, fork and tree decode for the speculation now under
verification (this is what overlaps the target); ``resolve`` takes the outcome ``(a, r')``, commits
it, looks it up in the speculation cache and falls back on a miss. The server keeps its own mirror
of the sequences, so it runs unchanged on a worker thread or in another process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from saguaro.config import SaguaroConfig
from saguaro.runtime.fallback import fast_fallback, neural_fallback
from saguaro.runtime.fan_out import OutcomeEstimator, resolve_fan_out
from saguaro.runtime.fork import ranks_from_ranked
from saguaro.runtime.model_runner import ModelRunner
from saguaro.runtime.sequences import SequenceBatch
from saguaro.runtime.verification import outcome_tokens
from saguaro.runtime import tree
from saguaro.schedule import lane_order, round_schedule

AUTO_NEURAL_MAX_BATCH = 8  # the paper: neural fallback pays at small batch, fast at large
SOURCES = ("neural", "fast", "hit")  # codes 0, 1, 2 of where a row's speculation came from


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
class Resolution:
    """The next speculation and how it was made."""

    tokens: torch.Tensor  # [B, K]
    probs: torch.Tensor | None  # [B, K, V]
    hit: torch.Tensor  # [B] bool
    source: torch.Tensor  # [B] long, index into SOURCES
    fallback_kind: str | None
    fallback_s: float


class FallbackPolicy:
    """``auto``: per round, the fallback with the higher expected tokens per second.

    Neural: ``acc_neural / (T_verify + T_neural)``; fast: ``acc_fast / T_verify``. Costs and accepted
    lengths are running means of what this generation measured; before both kinds are measured the
    batch size decides (neural up to ``AUTO_NEURAL_MAX_BATCH`` rows).
    """

    def __init__(self, kind: str, batch: int):
        self.kind = kind
        self.batch = batch
        self.accepted = {"neural": [], "fast": []}
        self.neural_s: list[float] = []
        self.verify_s: list[float] = []

    def choose(self) -> str:
        if self.kind != "auto":
            return self.kind
        if not (self.accepted["neural"] and self.accepted["fast"] and self.neural_s and self.verify_s):
            return "neural" if self.batch <= AUTO_NEURAL_MAX_BATCH else "fast"
        mean = lambda xs: sum(xs[-32:]) / len(xs[-32:])  # noqa: E731
        t_verify, t_neural = mean(self.verify_s), mean(self.neural_s)
        neural_rate = mean(self.accepted["neural"]) / (t_verify + t_neural)
        fast_rate = mean(self.accepted["fast"]) / t_verify
        return "neural" if neural_rate >= fast_rate else "fast"


class SpeculationServer:
    """Draft-side state of one generation at a time."""

    def __init__(self, draft: ModelRunner, config: SaguaroConfig):
        self.draft = draft
        self.config = config
        self.k = config.k
        self.vocab = draft.spec.vocab_size

    def open(self, spec: GenerateSpec) -> None:
        self.seqs = SequenceBatch(spec.input_ids, spec.attention_mask, spec.max_new_tokens, spec.capacity,
                                  spec.eos_token_ids, spec.pad_token_id)
        self.store = self.draft.new_store(self.seqs.batch, spec.capacity)
        self.temperature = spec.temperature
        self.generator = None
        if spec.temperature > 0:
            self.generator = torch.Generator(device=spec.input_ids.device).manual_seed(spec.seed)
        self.estimator = OutcomeEstimator(self.k)
        schedule = round_schedule("ssd", self.k, sampled=spec.temperature > 0)
        self.build_steps = [n for n in lane_order(schedule, "draft") if n != "fallback"]
        self.policy = FallbackPolicy(self.config.fallback, self.seqs.batch)
        self.cache = None
        T = self.seqs.prompt_len
        index = torch.arange(T, device=spec.input_ids.device).expand(self.seqs.batch, T)
        self.draft(self.store, self.seqs.tokens[:, :T], self.seqs.prompt_positions(), index)

    def start(self, first_tokens: torch.Tensor) -> Resolution:
        """The target's first token ``[B]`` arrives: decode the first speculation with the draft."""
        self.seqs.append(first_tokens[:, None], torch.ones_like(first_tokens))
        rows = torch.arange(self.seqs.batch, device=first_tokens.device)
        started = time.perf_counter()
        self.spec_tokens, self.spec_probs = neural_fallback(self.draft, self.store, self.seqs, rows, self.k,
                                                            self.temperature, self.generator)
        self.source = torch.zeros(self.seqs.batch, dtype=torch.long)
        return Resolution(self.spec_tokens, self.spec_probs, torch.zeros_like(rows, dtype=torch.bool),
                          self.source.clone(), None, time.perf_counter() - started)

    def build(self) -> None:
        """Glue, fork and tree decode for the speculation under verification (overlaps the target)."""
        seqs, k = self.seqs, self.k
        self.fan_out = resolve_fan_out(self.config.fan_out, k, self.config.budget, self.estimator, self.draft.width)
        index = seqs.tail_index(1) + torch.arange(k + 1, device=seqs.tokens.device)[None, :]  # [B, k+1]
        request = tree.GlueRequest(
            ids=torch.cat([seqs.gather(index[:, :1]), self.spec_tokens], dim=1), index=index,
            positions=seqs.positions(index), fan_out=self.fan_out, temperature=self.temperature,
            saguaro_c=float(self.config.saguaro_c))
        self.cache = tree.build_speculations(self.draft, self.store, request, self.generator, self.build_steps)

    def resolve(self, accepted: torch.Tensor, outcome: torch.Tensor, verify_s: float) -> Resolution:
        """Commit the outcome ``(a [B], r' [B])``, look it up, fall back for the missed rows."""
        seqs, k, cache = self.seqs, self.k, self.cache
        active = seqs.active.clone()
        self._learn(accepted, outcome, active, verify_s)
        seqs.append(outcome_tokens(self.spec_tokens, accepted, outcome), accepted + 1)
        self.store.invalidate_from(seqs.lengths - 1)  # keep r .. x_a of the glue, drop the rest
        hit, branch = cache.match(accepted, outcome)
        hit &= seqs.active
        tokens, probs = cache.speculation(branch)
        if self.temperature == 0.0:
            probs = None  # greedy verification needs no proposal distribution
        source = torch.where(hit, 2, torch.zeros_like(self.source))
        missed = (~hit & seqs.active).nonzero().flatten()
        kind, spent = None, 0.0
        if missed.numel():
            kind = self.policy.choose()
            started = time.perf_counter()
            if kind == "neural":
                fb_tokens, fb_probs = neural_fallback(self.draft, self.store, seqs, missed, k, self.temperature,
                                                      self.generator)
            else:
                fb_tokens, fb_probs = fast_fallback(seqs, missed, k, self.vocab, self.temperature)
            spent = time.perf_counter() - started
            if kind == "neural":
                self.policy.neural_s.append(spent)
            tokens = tokens.clone()
            tokens[missed] = fb_tokens
            if probs is not None:
                probs = probs.clone()
                probs[missed] = fb_probs
            source[missed] = SOURCES.index(kind)
        self.spec_tokens, self.spec_probs, self.source = tokens, probs, source
        return Resolution(tokens, probs, hit, source.clone(), kind, spent)

    @property
    def finished(self) -> bool:
        return self.seqs.all_finished()

    def _learn(self, accepted, outcome, active, verify_s) -> None:
        """Online α, ρ and the fallback policy's accepted lengths by source."""
        ranks = ranks_from_ranked(self.cache.ranked, accepted, outcome)
        self.estimator.observe(accepted[active], ranks[active])
        self.policy.verify_s.append(verify_s)
        for code, name in enumerate(SOURCES):
            rows = active & (self.source == code)
            if name in self.policy.accepted and bool(rows.any()):
                self.policy.accepted[name].extend((accepted[rows] + 1).tolist())
