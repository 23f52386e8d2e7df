"""Mode ``ssd``: speculative speculative decoding (DESIGN.md §1).

While the target verifies round ``t`` on the caller's thread, the draft lane runs glue, fork and
tree decode for the speculation under verification. When the outcome ``(a, r')`` arrives, a hit
issues the next speculation from the cache at once; a miss uses the neural or fast fallback. The
draft side lives in a :class:`~saguaro.runtime.draft_server.SpeculationServer` behind a lane.
"""

from __future__ import annotations

import logging
import warnings

import torch

from saguaro.runtime.decode_sd import decode_sd, verify_round
from saguaro.runtime.draft_server import SOURCES, GenerateSpec, Resolution
from saguaro.runtime.lanes import DraftLaneError
from saguaro.runtime.model_runner import ModelRunner
from saguaro.runtime.state import DecodeState

log = logging.getLogger(__name__)


def decode_ssd(target: ModelRunner, draft: ModelRunner, state: DecodeState, lane, spec: GenerateSpec,
               first_tokens: torch.Tensor) -> bool:
    """Run SSD rounds until every row finishes. Returns False when the lane failed.

    On a draft-lane failure the generation finishes exactly with SD on a fresh draft store.
    """
    seqs, timers = state.seqs, state.timers
    try:
        with timers.time("draft_s"):
            resolution = lane.open(spec, first_tokens)
        while not seqs.all_finished():
            lane.begin()  # the draft lane builds the cache for this speculation ...
            active = seqs.active.clone()
            verify_before = timers.seconds.get("verify_s", 0.0)
            # ... while the target verifies it
            accepted, outcome = verify_round(target, state, resolution.tokens, resolution.probs)
            _record_by_source(state, resolution.source, accepted, active)
            if seqs.all_finished():
                break
            resolution, waited = lane.finish(accepted, outcome, timers.seconds["verify_s"] - verify_before)
            timers.seconds["draft_wait_s"] = timers.seconds.get("draft_wait_s", 0.0) + waited
            _record_resolution(state, resolution, accepted, seqs.active)
    except DraftLaneError as exc:
        _finish_with_sd(target, draft, state, exc)
        return False
    finally:
        lane.settle()  # the last round's build, which no outcome needs, ends before generate returns
    return True


def _record_by_source(state: DecodeState, source: torch.Tensor, accepted: torch.Tensor, active) -> None:
    for code, name in enumerate(SOURCES):
        rows = active & (source == code)
        if bool(rows.any()):
            lengths = accepted[rows] + 1
            state.timers.count(f"accepted_after_{name}", int(lengths.sum()))
            state.timers.count(f"rounds_after_{name}", int(rows.sum()))


def _record_resolution(state: DecodeState, res: Resolution, accepted: torch.Tensor, active) -> None:
    timers = state.timers
    hit = res.hit & active
    timers.count("lookups", int(active.sum()))
    timers.count("hits", int(hit.sum()))
    for a in accepted[hit].tolist():
        timers.count(f"hits_at_{a}")
    if res.fallback_kind is not None:
        timers.count(f"fallback_{res.fallback_kind}", int((active & ~hit).sum()))
        key = f"fallback_{res.fallback_kind}_s"
        timers.seconds[key] = timers.seconds.get(key, 0.0) + res.fallback_s


def _finish_with_sd(target: ModelRunner, draft: ModelRunner, state: DecodeState, exc: Exception) -> None:
    """The draft lane failed: prefill a fresh draft store on this thread and finish exactly with SD."""
    warnings.warn(f"saguaro: {exc}; finishing this generation with SD (output stays exact)", RuntimeWarning,
                  stacklevel=4)
    state.timers.count("lane_failures")
    seqs = state.seqs
    state.draft_store = draft.new_store(seqs.batch, state.target_store.capacity)
    width = int(seqs.lengths.max()) - 1  # every decided token but the pending one of the longest row
    # shorter rows also write slots past their pending token; SD drops those before it drafts
    index = torch.arange(width, device=seqs.tokens.device).expand(seqs.batch, width)
    draft(state.draft_store, seqs.gather(index), seqs.positions(index).clamp_min(-1), index)
    decode_sd(target, draft, state)
