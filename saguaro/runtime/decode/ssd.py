"""Mode ``ssd``: speculative speculative decoding (``docs/design.md``, "The algorithm").

While the target verifies a speculation on the caller's thread, the draft lane runs glue, fork and
tree decode for it. When the outcome ``(a, r')`` arrives, a hit gives the next speculation at once; a
miss uses the neural or fast fallback. :func:`ssd_round` is one round, top to bottom; the draft side
is a :class:`~saguaro.runtime.draft.server.SpeculationServer` reached through a typed
:class:`~saguaro.runtime.lanes.protocol.DraftClient`.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from saguaro.core.warnings_at_caller import warn_at_caller
from saguaro.runtime.decode.ar import decode_ar
from saguaro.runtime.decode.sd import Outcome, sd_rounds, verify_and_commit
from saguaro.runtime.draft.server import Speculation
from saguaro.runtime.lanes.protocol import DraftClient, DraftLaneError
from saguaro.runtime.base.model_runner import ModelRunner
from saguaro.runtime.base.state import DecodeState
from saguaro.runtime.base.stats import SOURCES, Counters, since
from saguaro.runtime.base.trace import traced


def decode_ssd(target: ModelRunner, draft: ModelRunner, state: DecodeState, plan,
               first_tokens: torch.Tensor) -> None:
    """Run SSD rounds on ``plan.lane`` until every row finishes.

    On a draft-lane failure the generation finishes exactly with SD on a fresh draft store
    (``state.counters.lane_failures`` counts it; the caller drops the lane).
    """
    lane: DraftClient = plan.lane
    state.counters.verify_alone_s, plan_costs = plan.calibrated
    try:
        started = time.perf_counter()
        with traced(state.recorder, "host", "wait: first speculation"):
            lane.open(replace(plan.spec, plan_costs=plan_costs))  # the draft prefills the prompt ...
            speculation = lane.start(first_tokens)  # ... and decodes the first speculation
        state.counters.draft_s += since(started)
        while speculation is not None:
            with traced(state.recorder, "host", "round", {"round": state.counters.rounds + 1}):
                speculation = ssd_round(target, state, lane, speculation)
            state.round_committed()  # streaming: outside the round's clock and slice
    except DraftLaneError as exc:
        _finish_with_sd(target, draft, state, exc)
    finally:
        lane.settle()  # the last round's build, which no outcome needs, ends before generate returns


def ssd_round(target: ModelRunner, state: DecodeState, lane: DraftClient, speculation: Speculation) -> Speculation | None:
    """One round: verify ∥ build, match the outcome, hit or fallback, and the next speculation (None
    once every row has finished).

    Host syncs: one, :func:`~saguaro.runtime.decode.sd.verify_and_commit` reading the outcome with the rows'
    finished flags. Everything the
    host decides after it (finished, hits, misses, counters) is host data: the lane answers a match with
    host ``hit`` flags, and the speculation's ``source`` is a host list."""
    seqs, counters, recorder = state.seqs, state.counters, state.recorder
    round_started = time.perf_counter()
    # the draft lane builds the speculation cache for this speculation ...
    lane.build()
    # ... while the target verifies it
    verify_before = counters.verify_s
    # the round's one device→host read, of the outcome (greedy: the verify and the append in one stage call)
    outcome = verify_and_commit(target, state, speculation.tokens, speculation.probs)
    _count_by_source(counters, speculation.source, outcome)
    if seqs.all_finished():
        counters.end_round(since(round_started), outcome.decided)
        return None
    # the outcome (a, r') against the cache: waits for what is left of the build
    started = time.perf_counter()
    with traced(recorder, "host", "wait: match"):
        lookup = lane.match(outcome.accepted_if_active, outcome.next_token, counters.verify_s - verify_before)
    counters.draft_wait_s += since(started)
    active = seqs.host_active  # [B] after this round's append
    hit = [on and h for on, h in zip(active, lookup.hit)]  # [B]
    missed = [on and not h for on, h in zip(active, lookup.hit)]  # [B]
    _count_lookup(counters, hit, outcome.accepted, active)
    if recorder is not None:
        recorder.counter("host", "cache", hits=sum(hit), misses=sum(missed))
    if not any(missed):
        counters.end_round(since(round_started), outcome.decided)
        return lookup.speculation  # every row hit: no draft latency on the critical path
    # a miss: the draft decodes now (neural) or a free n-gram proposal (fast)
    started = time.perf_counter()
    with traced(recorder, "host", "wait: fallback"):
        fallen_back = lane.fallback(missed)
    counters.fallback_s += since(started)
    counters.fallbacks[fallen_back.fallback_kind] += sum(missed)
    counters.end_round(since(round_started), outcome.decided)
    return fallen_back


def _count_by_source(counters: Counters, source: list, outcome: Outcome) -> None:
    """Tokens decided and rounds by where each active row's speculation came from (host lists)."""
    for code, a, on in zip(source, outcome.accepted, outcome.active):
        if on:
            tally = counters.by_source[SOURCES[code]]
            tally.tokens += a + 1
            tally.rounds += 1


def _count_lookup(counters: Counters, hit: list, accepted: list, active: list) -> None:
    counters.lookups += sum(active)
    counters.hits += sum(hit)
    for a, h in zip(accepted, hit):
        if h:
            counters.hits_at[a] += 1


def _finish_with_sd(target: ModelRunner, draft: ModelRunner | None, state: DecodeState, exc: Exception) -> None:
    """The draft lane failed: prefill a fresh draft store on this thread and finish exactly with SD (with
    AR when the only draft is a remote one: ``draft`` None)."""
    warn_at_caller(f"saguaro: {exc}; finishing this generation with {'SD' if draft else 'AR'} (output stays exact)")
    state.counters.lane_failures += 1
    if draft is None:
        state.target_store.invalidate_from(state.seqs.tail_index(1)[:, 0])  # the last round's rejected slots
        decode_ar(target, None, state, None, None)
        return
    catch_up_draft(draft, state)
    sd_rounds(target, draft, state)


def catch_up_draft(draft: ModelRunner, state: DecodeState) -> None:
    """A fresh draft store for SD's rounds, filled on this thread with every decided token but the pending one
    (``state.draft_store``; left padding and each row's own padding are masked, as in the prefill)."""
    seqs = state.seqs
    state.draft_store = draft.new_store(seqs.batch, state.target_store.capacity)
    state.draft_feed = 2  # SD's first draft call rewrites the two last tokens, as after any prefill
    width = max(seqs.host_lengths) - 1  # every decided token but the pending one of the longest row
    # shorter rows also write slots past their pending token; SD drops those before it drafts
    index = torch.arange(width, device=seqs.tokens.device).expand(seqs.batch, width)
    draft(state.draft_store, seqs.gather(index), seqs.positions(index).clamp_min(-1), index)
