"""Mode ``ssd`` on a draft lane: the target verifies on the caller's thread while the lane's
``SpeculationServer``, reached only through a ``DraftClient``, builds the next speculations
(``reference.reference_ssd_round`` is the same round in turn)."""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from saguaro.core.warnings_at_caller import warn_at_caller
from saguaro.runtime.base.model_runner import ModelRunner
from saguaro.runtime.base.state import DecodeState
from saguaro.runtime.base.stats import SOURCES, Counters, seconds_since
from saguaro.runtime.base.trace import traced
from saguaro.runtime.decode.ar import decode_ar
from saguaro.runtime.decode.sd import Outcome, sd_rounds, verify_and_commit
from saguaro.runtime.draft.server import Speculation
from saguaro.runtime.lanes.protocol import DraftClient, DraftLaneError


def decode_ssd(
    target: ModelRunner, draft: ModelRunner, state: DecodeState, plan, first_tokens: torch.Tensor
) -> None:
    """SSD rounds on ``plan.lane`` until every row finishes; on a ``DraftLaneError``, exactly with SD
    (``counters.lane_failures``; the caller drops the lane)."""
    lane: DraftClient = plan.lane
    state.counters.verify_alone_s, plan_costs = plan.calibrated
    try:
        started = time.perf_counter()
        with traced(state.recorder, "host", "wait: first speculation"):
            lane.open(replace(plan.spec, plan_costs=plan_costs))  # the draft prefills the prompt ...
            speculation = lane.start(first_tokens)  # ... and decodes the first speculation
        state.counters.draft_s += seconds_since(started)
        while speculation is not None:
            with traced(state.recorder, "host", "round", {"round": state.counters.rounds + 1}):
                speculation = ssd_round(target, state, lane, speculation)
            state.round_committed()  # streaming: outside the round's clock and slice
    except DraftLaneError as exc:
        _finish_with_sd(target, draft, state, exc)
    finally:
        lane.settle()  # the last round's build, which no outcome needs, ends before generate returns


def ssd_round(
    target: ModelRunner, state: DecodeState, lane: DraftClient, speculation: Speculation
) -> Speculation | None:
    """One round: build ∥ verify and commit, match, fallback; the next speculation, None once every row has
    finished. One host sync (the outcome's read): the lane's answers are host lists."""
    seqs, counters, recorder = state.seqs, state.counters, state.recorder
    round_started = time.perf_counter()
    # the draft lane builds the speculation cache for this speculation ...
    lane.build()
    # ... while the target verifies it
    verify_before = counters.verify_s
    # the round's one device→host read, of the outcome (greedy: the verify and the append in one stage call)
    outcome = verify_and_commit(target, state, speculation.tokens, speculation.probs)
    count_by_source(counters, speculation.source, outcome)
    if seqs.all_finished():
        counters.end_round(seconds_since(round_started), outcome.decided)
        return None
    # the outcome (a, r') against the cache: waits for what is left of the build
    started = time.perf_counter()
    with traced(recorder, "host", "wait: match"):
        lookup = lane.match(outcome.accepted_if_active, outcome.next_token, counters.verify_s - verify_before)
    counters.draft_wait_s += seconds_since(started)
    active = seqs.host_active  # [B] after this round's append
    hit = [on and h for on, h in zip(active, lookup.hit)]  # [B]
    missed = [on and not h for on, h in zip(active, lookup.hit)]  # [B]
    count_lookup(counters, hit, outcome.accepted, active)
    if recorder is not None:
        recorder.counter("host", "cache", hits=sum(hit), misses=sum(missed))
    if not any(missed):
        counters.end_round(seconds_since(round_started), outcome.decided)
        return lookup.speculation  # every row hit: no draft latency on the critical path
    # a miss: the draft decodes now (neural) or a free n-gram proposal (fast)
    started = time.perf_counter()
    with traced(recorder, "host", "wait: fallback"):
        fallen_back = lane.fallback(missed)
    counters.fallback_s += seconds_since(started)
    counters.fallbacks[fallen_back.fallback_kind] += sum(missed)
    counters.end_round(seconds_since(round_started), outcome.decided)
    return fallen_back


def count_by_source(counters: Counters, source: list, outcome: Outcome) -> None:
    """Tokens decided and rounds by where each active row's speculation came from (host lists)."""
    for code, a, on in zip(source, outcome.accepted, outcome.active):
        if on:
            tally = counters.by_source[SOURCES[code]]
            tally.tokens += a + 1
            tally.rounds += 1


def count_lookup(counters: Counters, hit: list, accepted: list, active: list) -> None:
    counters.lookups += sum(active)
    counters.hits += sum(hit)
    for a, h in zip(accepted, hit):
        if h:
            counters.hits_at[a] += 1


def _finish_with_sd(
    target: ModelRunner, draft: ModelRunner | None, state: DecodeState, exc: Exception
) -> None:
    """Finish on this thread after a lane failure: SD on a fresh draft store, AR where ``draft`` is None."""
    warn_at_caller(
        f"saguaro: {exc}; finishing this generation with {'SD' if draft else 'AR'} (output stays exact)"
    )
    state.counters.lane_failures += 1
    if draft is None:
        state.target_store.invalidate_from(state.seqs.tail_index(1)[:, 0])  # the last round's rejected slots
        decode_ar(target, None, state, None, None)
        return
    catch_up_draft(draft, state)
    sd_rounds(target, draft, state)


def catch_up_draft(draft: ModelRunner, state: DecodeState) -> None:
    """``state.draft_store``: a fresh store holding every decided token but ``r`` (padding masked), for SD."""
    seqs = state.seqs
    state.draft_store = draft.new_store(seqs.batch, state.target_store.capacity)
    state.draft_feed = 2  # SD's first draft call rewrites the two last tokens, as after any prefill
    width = max(seqs.host_lengths) - 1  # every decided token but the pending one of the longest row
    # shorter rows also write slots past their pending token; SD drops those before it drafts
    index = torch.arange(width, device=seqs.tokens.device).expand(seqs.batch, width)
    draft(state.draft_store, seqs.gather(index), seqs.positions(index).clamp_min(-1), index)
