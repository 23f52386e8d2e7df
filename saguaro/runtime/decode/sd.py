"""Mode ``sd``: ordinary speculative decoding. Draft ``k`` tokens, verify ``k+1`` in one target call.

:func:`verify` and :func:`commit` are the target side of every speculative round, SD's and SSD's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from saguaro.core.stages import TARGET_VERIFY, TARGET_VERIFY_ROUND
from saguaro.runtime.decode.controlled import in_effect, verify_controlled
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
    token before ``r`` — missing when the previous round accepted every draft token — and of ``r``; only
    ``r`` when the last round's outcome showed that no active row accepted all ``k`` (``state.draft_feed``:
    the draft's KV of the token before ``r`` is then the one its own step wrote, so the tokens are the same).
    """
    seqs = state.seqs
    if seqs.next_inputs is not None:  # made by the last round's stage
        ids, index, positions = seqs.next_inputs[:3]  # [B, 2] x 3
    else:
        index = seqs.tail_index(2)  # [B, 2]
        ids, positions = seqs.gather(index), seqs.positions(index)
    if state.draft_feed == 1:
        ids, index, positions = ids[:, 1:], index[:, 1:], positions[:, 1:]  # [B, 1] x 3 (draft_decode copies)
    return draft_decode(draft, state.draft_store, ids, index, positions, state.k, state.temperature, state.generator)


def verify(target: ModelRunner, state: DecodeState, draft_tokens: torch.Tensor,
           draft_probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One target call over ``[r, x_1..x_k]`` with verification fused in: ``(accepted [B], next [B])``; with
    sampling controls in effect, the logits' call and the verification of :mod:`~saguaro.runtime.decode.controlled`."""
    seqs, k = state.seqs, state.k
    ids, positions, index = verify_inputs(state, draft_tokens)
    stage = TARGET_VERIFY.at(state.temperature)
    watch = Stopwatch(ids.device)  # device time: on CUDA, events on the caller's stream
    controls = in_effect(state)
    if controls is not None:
        accepted, next_token = verify_controlled(target, state, ids, positions, index, draft_tokens, draft_probs,
                                                 controls)
    elif state.temperature == 0.0:
        accepted, next_token = target.run(stage, state.target_store, ids, positions, index, draft_tokens)
    else:
        accept_u, resample_u = verification.verification_uniforms(seqs.batch, k, state.generator, ids.device)
        inv_t = torch.full((), 1.0 / state.temperature, device=ids.device)  # a fill: no host copy, no sync
        accepted, next_token = target.run(stage, state.target_store, ids, positions, index, draft_tokens,
                                          draft_probs, inv_t, accept_u, resample_u)
    state.counters.time_verify(watch.stop())  # read once commit's read has waited for it: never a wait of its own
    return accepted, next_token


def verify_inputs(state: DecodeState, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The verify's ``input_ids`` ``[r, x_1..x_k]``, positions and slots ``[B, k+1]``, the previous round's
    rejected slots dropped from the target's store."""
    seqs = state.seqs
    if seqs.next_inputs is not None:  # made by the last round's stage
        pending, index, positions = seqs.next_inputs[0][:, 1:], seqs.next_inputs[3], seqs.next_inputs[4]
    else:
        index = seqs.forward_index(state.k + 1)  # [B, k+1]
        pending, positions = seqs.gather(index[:, :1]), seqs.positions(index)  # [B, 1], [B, k+1]
    state.target_store.invalidate_from(index[:, 0])
    return torch.cat([pending, draft_tokens], dim=1), positions, index


def verify_round(target: ModelRunner, state: DecodeState, draft_tokens: torch.Tensor) -> Outcome:
    """A greedy round's target side in one call of :data:`~saguaro.core.stages.TARGET_VERIFY_ROUND`: the
    verify, ``x_1..x_a, r'`` appended to the sequence buffers (``tensor_math.verify_round``, the function
    ``SequenceBatch.append`` runs), the outcome packed with the finished flags and lengths, and the next
    round's inputs (:func:`queue_verify_round`); then the round's one read, of that outcome."""
    seqs = state.seqs
    active = seqs.host_active  # before this append: from the previous round's read
    outcome = queue_verify_round(target, state, draft_tokens)  # [4, B]
    with traced(state.recorder, "host", "commit"):
        return counted(state, Outcome(active, *seqs.take_outcome(outcome)))


def queue_verify_round(target: ModelRunner, state: DecodeState, draft_tokens: torch.Tensor) -> torch.Tensor:
    """Queue the round stage's call (device work only: no read) and hand its new lengths, finished flags and
    next round's inputs to the sequences; returns the packed ``outcome [4, B]``, not yet read."""
    seqs = state.seqs
    ids, positions, index = verify_inputs(state, draft_tokens)
    watch = Stopwatch(ids.device)  # device time: on CUDA, events on the caller's stream
    outcome, lengths, finished, *next_inputs = target.run(
        TARGET_VERIFY_ROUND, state.target_store, ids, positions, index, draft_tokens, seqs.tokens, seqs.lengths,
        seqs.finished, seqs.padding, seqs.eos_table(target.spec.vocab_size), seqs.end)
    state.counters.time_verify(watch.stop())  # read once the outcome's read has waited for it
    seqs.advanced(lengths, finished, tuple(next_inputs))
    return outcome


def verify_and_commit(target: ModelRunner, state: DecodeState, draft_tokens: torch.Tensor,
                      draft_probs: torch.Tensor | None) -> Outcome:
    """Verify a speculation and commit its outcome: :func:`verify_round` where the target offers the greedy
    round stage (and no sampling control in effect), else :func:`verify` then :func:`commit`. One device→host
    read."""
    if state.temperature == 0 and target.provides(TARGET_VERIFY_ROUND) and in_effect(state) is None:
        return verify_round(target, state, draft_tokens)
    accepted, next_token = verify(target, state, draft_tokens, draft_probs)
    return commit(state, draft_tokens, accepted, next_token)


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
    with traced(state.recorder, "host", "commit"):
        seqs.append(verification.outcome_tokens(draft_tokens, accepted, next_token), accepted + 1)
        return counted(state, Outcome(active, *seqs.read(accepted, next_token)))


def counted(state: DecodeState, outcome: Outcome) -> Outcome:
    """Count a round's ``outcome``, just read from the device."""
    state.counters.settle()  # the verify's timing events, passed by the device before the read returned
    decided = outcome.decided
    # the next draft call feeds one token unless a row accepted all k (the draft never saw the last of them)
    state.draft_feed = 2 if any(a >= state.k for a in outcome.accepted_if_active if a is not None) else 1
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
    replay = graphed_sd_round(target, draft, state, draft_speculation, verify) if in_effect(state) is None else None
    while not state.seqs.all_finished():
        with traced(state.recorder, "host", "round", {"round": state.counters.rounds + 1}):
            started = time.perf_counter()
            if replay is not None:
                watch = Stopwatch(state.seqs.tokens.device)
                draft_tokens, accepted, next_token = replay()
                state.counters.time_verify(watch.stop())  # counted once commit's read has passed it
                outcome = commit(state, draft_tokens, accepted, next_token)
            else:
                draft_tokens, draft_probs = draft_speculation(draft, state)
                state.counters.draft_s += since(started)
                outcome = verify_and_commit(target, state, draft_tokens, draft_probs)
            state.counters.end_round(since(started), outcome.decided)
        state.round_committed()  # streaming: outside the round's clock and slice
