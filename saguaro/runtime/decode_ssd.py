"""Mode ``ssd``: speculative speculative decoding (``docs/design.md``, "The algorithm").

While the target verifies a speculation on the caller's thread, the draft lane runs glue, fork and
tree decode for it. When the outcome ``(a, r')`` arrives, a hit gives the next speculation at once; a
miss uses the neural or fast fallback. :func:`ssd_round` is one round, top to bottom; the draft side
is a :class:`~saguaro.runtime.draft_server.SpeculationServer` the lane calls by method name.
"""

from __future__ import annotations

import time

import torch

from saguaro.core.warnings_at_caller import warn_at_caller
from saguaro.runtime.decode_sd import commit, decode_sd, verify
from saguaro.runtime.draft_server import GenerateSpec, Speculation
from saguaro.runtime.lanes import DraftLaneError
from saguaro.runtime.model_runner import ModelRunner
from saguaro.runtime.state import DecodeState
from saguaro.runtime.stats import SOURCES, Counters, since
from saguaro.runtime.trace import traced


def decode_ssd(target: ModelRunner, draft: ModelRunner, state: DecodeState, lane, spec: GenerateSpec,
               first_tokens: torch.Tensor) -> bool:
    """Run SSD rounds until every row finishes. Returns False when the lane failed.

    On a draft-lane failure the generation finishes exactly with SD on a fresh draft store.
    """
    try:
        started = time.perf_counter()
        with traced(state.recorder, "host", "wait: first speculation"):
            lane.call("open", spec)  # the draft prefills the prompt ...
            speculation = lane.call("start", first_tokens)  # ... and decodes the first speculation
        state.counters.draft_s += since(started)
        while speculation is not None:
            with traced(state.recorder, "host", "round", {"round": state.counters.rounds + 1}):
                speculation = ssd_round(target, state, lane, speculation)
    except DraftLaneError as exc:
        _finish_with_sd(target, draft, state, exc)
        return False
    finally:
        lane.settle()  # the last round's build, which no outcome needs, ends before generate returns
    return True


def ssd_round(target: ModelRunner, state: DecodeState, lane, speculation: Speculation) -> Speculation | None:
    """One round: verify ∥ build, match the outcome, hit or fallback, and the next speculation (None
    once every row has finished)."""
    seqs, counters, recorder = state.seqs, state.counters, state.recorder
    active = seqs.active.clone()
    round_started = time.perf_counter()
    # the draft lane builds the speculation cache for this speculation ...
    lane.post("build")
    # ... while the target verifies it
    verify_before = counters.verify_s
    accepted, next_token = verify(target, state, speculation.tokens, speculation.probs)  # [B], [B]
    with traced(recorder, "host", "commit"):
        decided = commit(state, speculation.tokens, accepted, next_token)
        _count_by_source(counters, speculation.source, accepted, active)
    if seqs.all_finished():
        counters.end_round(since(round_started), decided)
        return None
    # the outcome (a, r') against the cache: waits for what is left of the build
    started = time.perf_counter()
    with traced(recorder, "host", "wait: match"):
        lookup = lane.call("match", accepted, next_token, counters.verify_s - verify_before)
    counters.draft_wait_s += since(started)
    missed = seqs.active & ~lookup.hit  # [B]
    _count_lookup(counters, lookup.hit & seqs.active, accepted, seqs.active)
    if recorder is not None:
        hits = int((lookup.hit & seqs.active).sum())
        recorder.counter("host", "cache", hits=hits, misses=int(missed.sum()))
    if not bool(missed.any()):
        counters.end_round(since(round_started), decided)
        return lookup.speculation  # every row hit: no draft latency on the critical path
    # a miss: the draft decodes now (neural) or a free n-gram proposal (fast)
    started = time.perf_counter()
    with traced(recorder, "host", "wait: fallback"):
        fallen_back = lane.call("fallback", missed)
    counters.fallback_s += since(started)
    counters.fallbacks[fallen_back.fallback_kind] += int(missed.sum())
    counters.end_round(since(round_started), decided)
    return fallen_back


def _count_by_source(counters: Counters, source: torch.Tensor, accepted: torch.Tensor, active) -> None:
    for code, name in enumerate(SOURCES):
        rows = active & (source == code)
        if bool(rows.any()):
            counters.by_source[name].tokens += int((accepted[rows] + 1).sum())
            counters.by_source[name].rounds += int(rows.sum())


def _count_lookup(counters: Counters, hit: torch.Tensor, accepted: torch.Tensor, active) -> None:
    counters.lookups += int(active.sum())
    counters.hits += int(hit.sum())
    for a in accepted[hit].tolist():
        counters.hits_at[a] += 1


def _finish_with_sd(target: ModelRunner, draft: ModelRunner, state: DecodeState, exc: Exception) -> None:
    """The draft lane failed: prefill a fresh draft store on this thread and finish exactly with SD."""
    warn_at_caller(f"saguaro: {exc}; finishing this generation with SD (output stays exact)")
    state.counters.lane_failures += 1
    seqs = state.seqs
    state.draft_store = draft.new_store(seqs.batch, state.target_store.capacity)
    width = int(seqs.lengths.max()) - 1  # every decided token but the pending one of the longest row
    # shorter rows also write slots past their pending token; SD drops those before it drafts
    index = torch.arange(width, device=seqs.tokens.device).expand(seqs.batch, width)
    draft(state.draft_store, seqs.gather(index), seqs.positions(index).clamp_min(-1), index)
    decode_sd(target, draft, state)
