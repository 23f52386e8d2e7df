"""Mode ``sd``: ordinary speculative decoding. Draft ``k`` tokens, verify ``k+1`` in one target call.

:func:`verify` and :func:`commit` are the target side of every speculative round, SD's and SSD's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from saguaro.core.stages import TARGET_VERIFY
from saguaro.runtime.decode.sd_graph import graphed_sd_round
from saguaro.runtime.draft.decode import draft_decode
from saguaro.runtime.base.model_runner import ModelRunner
from saguaro.runtime.base.state import DecodeState
from saguaro.runtime.base.stats import since
from saguaro.runtime.base.timing import Stopwatch
from saguaro.runtime.base.trace import traced
from saguaro.tensor_math import verification


def draft_speculation(draft: ModelRunner, state: DecodeState) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft ``k`` tokens after each row's pending token: ``tokens [B, k]`` and ``probs [B, k, V]``.

    The first draft call feeds the last two tokens of each row, so it (re)writes the draft KV of the
    token before ``r`` — missing when the previous round accepted every draft token — and of ``r``.
    """
    seqs = state.seqs
    index = seqs.tail_index(2)  # [B, 2]
    return draft_decode(draft, state.draft_store, seqs.gather(index), index, seqs.positions(index), state.k,
                        state.temperature, state.generator)


def verify(target: ModelRunner, state: DecodeState, draft_tokens: torch.Tensor,
           draft_probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One target call over ``[r, x_1..x_k]`` with verification fused in: ``(accepted [B], next [B])``."""
    seqs, k = state.seqs, state.k
    index = seqs.forward_index(k + 1)  # [B, k+1]
    ids = torch.cat([seqs.gather(index[:, :1]), draft_tokens], dim=1)  # [B, k+1]
    state.target_store.invalidate_from(index[:, 0])  # drop the previous round's rejected slots
    positions = seqs.positions(index)
    stage = TARGET_VERIFY.at(state.temperature)
    watch = Stopwatch(ids.device)  # device time: on CUDA, events on the caller's stream
    if state.temperature == 0.0:
        accepted, next_token = target.run(stage, state.target_store, ids, positions, index, draft_tokens)
    else:
        accept_u, resample_u = verification.verification_uniforms(seqs.batch, k, state.generator, ids.device)
        inv_t = torch.full((), 1.0 / state.temperature, device=ids.device)  # a fill: no host copy, no sync
        accepted, next_token = target.run(stage, state.target_store, ids, positions, index, draft_tokens,
                                          draft_probs, inv_t, accept_u, resample_u)
    state.counters.time_verify(watch.stop())  # read once commit's read has waited for it: never a wait of its own
    return accepted, next_token


@dataclass
class Outcome:
    """A round's outcome on the host, from the round's one device→host read: ``accepted [B]`` and
    ``next_token [B]`` (``r'``) of every row, and which rows were ``active`` (unfinished) before it."""

    active: list
    accepted: list
    next_token: list

    @property
    def decided(self) -> list:
        """Tokens decided (accepted + 1) per row that was active."""
        return [a + 1 for a, on in zip(self.accepted, self.active) if on]

    @property
    def accepted_if_active(self) -> list:
        """``accepted [B]`` with None on the rows that were not active (what the draft server is told)."""
        return [a if on else None for a, on in zip(self.accepted, self.active)]


def commit(state: DecodeState, draft_tokens: torch.Tensor, accepted: torch.Tensor,
           next_token: torch.Tensor) -> Outcome:
    """Append ``x_1..x_a, r'`` to each active row, record the accepted lengths, and read the outcome
    (with the rows' finished flags and lengths) to the host: the round's one device→host sync."""
    seqs = state.seqs
    active = seqs.host_active  # before this append: from the previous round's read
    seqs.append(verification.outcome_tokens(draft_tokens, accepted, next_token), accepted + 1)
    host_accepted, host_next = seqs.read(accepted, next_token)
    state.counters.settle()  # the verify's timing events, passed by the device before this read returned
    outcome = Outcome(active, host_accepted, host_next)
    decided = outcome.decided
    state.counters.accepted_lengths.extend(decided)
    state.counters.rounds += 1
    if state.recorder is not None:
        state.recorder.counter("host", "accepted length", mean=sum(decided) / len(decided) if decided else 0.0)
    return outcome


def decode_sd(target: ModelRunner, draft: ModelRunner, state: DecodeState, plan, first_tokens) -> None:
    """Mode ``sd`` (every decoder's signature; the plan and the first tokens, already in ``state``, are
    not needed): :func:`sd_rounds`."""
    sd_rounds(target, draft, state)


def sd_rounds(target: ModelRunner, draft: ModelRunner, state: DecodeState) -> None:
    """Alternate drafting and verification until every row finishes (under CUDA graphs, greedy: both in one
    replay, :mod:`~saguaro.runtime.decode.sd_graph`, its time counted as the verify's)."""
    replay = graphed_sd_round(target, draft, state, draft_speculation, verify)
    while not state.seqs.all_finished():
        with traced(state.recorder, "host", "round", {"round": state.counters.rounds + 1}):
            started = time.perf_counter()
            if replay is not None:
                watch = Stopwatch(state.seqs.tokens.device)
                draft_tokens, accepted, next_token = replay()
                state.counters.time_verify(watch.stop())  # counted once commit's read has passed it
            else:
                draft_tokens, draft_probs = draft_speculation(draft, state)
                state.counters.draft_s += since(started)
                accepted, next_token = verify(target, state, draft_tokens, draft_probs)
            state.counters.end_round(since(started), commit(state, draft_tokens, accepted, next_token).decided)
        state.round_committed()  # streaming: outside the round's clock and slice
