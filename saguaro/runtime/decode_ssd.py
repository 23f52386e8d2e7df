"""Mode ``ssd``: speculative speculative decoding (DESIGN.md §1).

While the target verifies round ``t`` on the caller's thread, the draft lane runs glue, fork and
tree decode for the speculation under verification. When the outcome ``(a, r')`` arrives, a hit
issues the next speculation from the cache at once; a miss uses the neural or fast fallback.
"""

from __future__ import annotations

import logging
import time
import warnings

import torch

from saguaro.config import SaguaroConfig
from saguaro.runtime.decode_ar import decode_ar
from saguaro.runtime.decode_sd import decode_sd, verify_round
from saguaro.runtime.fallback import fast_fallback, neural_fallback
from saguaro.runtime.fan_out import OutcomeEstimator, resolve_fan_out
from saguaro.runtime.fork import candidate_ranks
from saguaro.runtime.lanes import DraftLaneError, ThreadLane
from saguaro.runtime.model_runner import ModelRunner
from saguaro.runtime.state import DecodeState
from saguaro.runtime import tree

log = logging.getLogger(__name__)

AUTO_NEURAL_MAX_BATCH = 8  # the paper: neural fallback pays at small batch, fast at large


class FallbackPolicy:
    """``auto``: per round, the fallback with the higher expected tokens per second.

    Neural: ``acc_neural / (T_verify + T_neural)``; fast: ``acc_fast / T_verify``. Costs and accepted
    lengths are running means of what this generation measured; before any measurement the batch
    size decides (neural up to ``AUTO_NEURAL_MAX_BATCH`` rows).
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


def decode_ssd(target: ModelRunner, draft: ModelRunner, state: DecodeState, config: SaguaroConfig,
               lane: ThreadLane, draft_generator: torch.Generator | None) -> None:
    """Run SSD rounds until every row finishes; on a draft-lane failure finish exactly with SD or AR."""
    seqs, k, timers = state.seqs, state.k, state.timers
    V = target.spec.vocab_size
    estimator = OutcomeEstimator(k)
    policy = FallbackPolicy(config.fallback, seqs.batch)
    cap = V  # row K has no excluded token, so it can hold every token
    all_rows = torch.arange(seqs.batch, device=seqs.tokens.device)
    with timers.time("draft_s"):  # the first speculation has no cache to come from
        spec_tokens, spec_probs = neural_fallback(draft, state.draft_store, seqs, all_rows, k, state.temperature,
                                                  draft_generator)
    source = torch.zeros(seqs.batch, dtype=torch.long)  # 0 neural, 1 fast, 2 hit
    while not seqs.all_finished():
        fan_out = resolve_fan_out(config.fan_out, k, config.budget, estimator, cap)
        index = seqs.tail_index(1) + torch.arange(k + 1, device=spec_tokens.device)[None, :]  # [B, k+1]
        request = tree.GlueRequest(
            ids=torch.cat([seqs.gather(index[:, :1]), spec_tokens], dim=1), index=index,
            positions=seqs.positions(index), fan_out=fan_out, temperature=state.temperature,
            saguaro_c=float(config.saguaro_c))
        future = lane.submit(tree.build_speculations, draft, state.draft_store, request, draft_generator)
        active = seqs.active.clone()
        verify_before = timers.seconds.get("verify_s", 0.0)
        accepted, outcome = verify_round(target, state, spec_tokens, spec_probs)
        policy.verify_s.append(timers.seconds["verify_s"] - verify_before)
        _record_by_source(state, source, accepted, active, policy)
        try:
            with timers.time("draft_wait_s"):
                cache = lane.result(future)
        except DraftLaneError as exc:
            _finish_without_lane(target, draft, state, exc, worker_finished=future.done())
            return
        estimator.observe(accepted[active], candidate_ranks(cache.glue_logits, spec_tokens, accepted, outcome)[active])
        state.draft_store.invalidate_from(seqs.lengths - 1)  # keep r .. x_a of the glue, drop the rest
        if seqs.all_finished():
            break
        hit, branch = cache.match(accepted, outcome)
        hit &= seqs.active
        _record_hits(state, hit, accepted, seqs.active)
        spec_tokens, spec_probs = cache.speculation(branch)
        if state.temperature == 0.0:
            spec_probs = None  # greedy verification needs no proposal distribution
        source = torch.where(hit, 2, source.new_zeros(()))
        missed = (~hit & seqs.active).nonzero().flatten()
        if missed.numel():
            kind = policy.choose()
            timers.count(f"fallback_{kind}", missed.numel())
            started = time.perf_counter()
            if kind == "neural":
                fb_tokens, fb_probs = neural_fallback(draft, state.draft_store, seqs, missed, k, state.temperature,
                                                      draft_generator)
                policy.neural_s.append(time.perf_counter() - started)
            else:
                fb_tokens, fb_probs = fast_fallback(seqs, missed, k, V, state.temperature)
            timers.seconds[f"fallback_{kind}_s"] = timers.seconds.get(f"fallback_{kind}_s", 0.0) + (
                time.perf_counter() - started)
            spec_tokens = spec_tokens.clone()
            spec_tokens[missed] = fb_tokens
            if spec_probs is not None:
                spec_probs = spec_probs.clone()
                spec_probs[missed] = fb_probs
            source[missed] = 0 if kind == "neural" else 1


def _record_by_source(state, source, accepted, active, policy) -> None:
    names = {0: "neural", 1: "fast", 2: "hit"}
    for code, name in names.items():
        rows = active & (source == code)
        if bool(rows.any()):
            lengths = (accepted[rows] + 1).tolist()
            state.timers.count(f"accepted_after_{name}", sum(lengths))
            state.timers.count(f"rounds_after_{name}", len(lengths))
            if name in policy.accepted:
                policy.accepted[name].extend(lengths)


def _record_hits(state, hit, accepted, active) -> None:
    state.timers.count("lookups", int(active.sum()))
    state.timers.count("hits", int(hit.sum()))
    for a in accepted[hit].tolist():
        state.timers.count(f"hits_at_{a}")


def _finish_without_lane(target, draft, state, exc, worker_finished: bool) -> None:
    """The draft lane failed: finish the generation exactly, with SD if the draft is safe, else AR."""
    state.timers.count("lane_failures")
    if worker_finished:
        warnings.warn(f"saguaro: {exc}; finishing this generation with SD (output stays exact)", RuntimeWarning,
                      stacklevel=3)
        decode_sd(target, draft, state)
    else:  # a worker that may still write the draft store must not share it: target alone
        warnings.warn(f"saguaro: {exc}; finishing this generation with AR (output stays exact)", RuntimeWarning,
                      stacklevel=3)
        decode_ar(target, state)
