"""Mode ``sd``'s fast rounds (the reference: ``reference.reference_sd_round``), and :func:`verify` and
:func:`commit`, the target side of SD's and SSD's rounds."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from saguaro.core.stages import TARGET_VERIFY, TARGET_VERIFY_ROUND
from saguaro.runtime.base.model_runner import ModelRunner
from saguaro.runtime.base.state import DecodeState
from saguaro.runtime.base.stats import seconds_since
from saguaro.runtime.base.timing import Stopwatch
from saguaro.runtime.base.trace import traced
from saguaro.runtime.decode.controlled import draft_under_grammar, grammar_rows, in_effect, verify_controlled
from saguaro.runtime.decode.sd_graph import graphed_sd_round
from saguaro.runtime.draft.decode import draft_decode
from saguaro.tensor_math import verification


def draft_speculation(draft: ModelRunner, state: DecodeState) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``k`` tokens after ``r``, feeding ``draft_feed`` tokens: ``tokens [B, k]``, ``probs`` (None greedy)."""
    seqs = state.seqs
    if seqs.next_inputs is not None:  # made by the last round's stage
        ids, index, positions = seqs.next_inputs[:3]  # [B, 2] x 3
    else:
        index = seqs.tail_index(2)  # [B, 2]
        ids, positions = seqs.gather(index), seqs.positions(index)
    if state.draft_feed == 1:
        ids, index, positions = ids[:, 1:], index[:, 1:], positions[:, 1:]  # [B, 1] x 3 (draft_decode copies)
    if (
        grammar_rows(state) is not None
    ):  # proposals from the draft's distribution masked by each row's grammar
        return draft_under_grammar(draft, state, ids, index, positions)
    return draft_decode(
        draft, state.draft_store, ids, index, positions, state.k, state.temperature, state.generator
    )


def verify(
    target: ModelRunner, state: DecodeState, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One verify call over ``[r, x_1..x_k]``: ``(accepted [B], next_token [B])`` on the device, no read
    (under sampling controls, ``controlled.verify_controlled``). ``draft_probs`` is required when sampled."""
    seqs, k = state.seqs, state.k
    ids, positions, index = verify_inputs(state, draft_tokens)
    stage = TARGET_VERIFY.for_temperature(state.temperature)
    watch = Stopwatch(ids.device)  # device time: on CUDA, events on the caller's stream
    controls = in_effect(state)
    if controls is not None:
        accepted, next_token = verify_controlled(
            target, state, ids, positions, index, draft_tokens, draft_probs, controls
        )
    elif state.temperature == 0.0:
        accepted, next_token = target.run(stage, state.target_store, ids, positions, index, draft_tokens)
    else:
        accept_u, resample_u = verification.verification_uniforms(seqs.batch, k, state.generator, ids.device)
        inv_t = torch.full((), 1.0 / state.temperature, device=ids.device)  # a fill: no host copy, no sync
        accepted, next_token = target.run(
            stage,
            state.target_store,
            ids,
            positions,
            index,
            draft_tokens,
            draft_probs,
            inv_t,
            accept_u,
            resample_u,
        )
    state.counters.time_verify(
        watch.stop()
    )  # read once commit's read has waited for it: never a wait of its own
    return accepted, next_token


def verify_inputs(state: DecodeState, draft_tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The verify's ``(input_ids, positions, slots)`` ``[B, k+1]``; empties the target's slots from ``r``."""
    seqs = state.seqs
    if seqs.next_inputs is not None:  # made by the last round's stage
        pending, index, positions = seqs.next_inputs[0][:, 1:], seqs.next_inputs[3], seqs.next_inputs[4]
    else:
        index = seqs.forward_index(state.k + 1)  # [B, k+1]
        pending, positions = seqs.gather(index[:, :1]), seqs.positions(index)  # [B, 1], [B, k+1]
    state.target_store.invalidate_from(index[:, 0])
    return torch.cat([pending, draft_tokens], dim=1), positions, index


def verify_round(target: ModelRunner, state: DecodeState, draft_tokens: torch.Tensor) -> Outcome:
    """:func:`verify` and :func:`commit` fused (greedy): one ``TARGET_VERIFY_ROUND`` call, one read."""
    seqs = state.seqs
    active = seqs.host_active  # before this append: from the previous round's read
    outcome = queue_verify_round(target, state, draft_tokens)  # [4, B]
    with traced(state.recorder, "host", "commit"):
        read = count_round(state, Outcome(active, *seqs.read_outcome(outcome)))
    state.draft_feed = draft_feed_after(read, state.k)
    return read


def queue_verify_round(target: ModelRunner, state: DecodeState, draft_tokens: torch.Tensor) -> torch.Tensor:
    """The ``TARGET_VERIFY_ROUND`` call, no read (the sequences take its results): ``outcome [4, B]``."""
    seqs = state.seqs
    ids, positions, index = verify_inputs(state, draft_tokens)
    watch = Stopwatch(ids.device)  # device time: on CUDA, events on the caller's stream
    outcome, lengths, finished, *next_inputs = target.run(
        TARGET_VERIFY_ROUND,
        state.target_store,
        ids,
        positions,
        index,
        draft_tokens,
        seqs.tokens,
        seqs.lengths,
        seqs.finished,
        seqs.padding,
        seqs.eos_table(target.spec.vocab_size),
        seqs.end,
    )
    state.counters.time_verify(watch.stop())  # read once the outcome's read has waited for it
    seqs.set_lengths_and_finished(lengths, finished, tuple(next_inputs))
    return outcome


def verify_and_commit(
    target: ModelRunner, state: DecodeState, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None
) -> Outcome:
    """:func:`verify_round` where the target offers it (greedy, no sampling control), else :func:`verify`
    and :func:`commit`: the outcome, one device→host read."""
    if state.temperature == 0 and target.provides(TARGET_VERIFY_ROUND) and in_effect(state) is None:
        return verify_round(target, state, draft_tokens)
    accepted, next_token = verify(target, state, draft_tokens, draft_probs)
    return commit(state, draft_tokens, accepted, next_token)


@dataclass
class Outcome:
    """A round's outcome on the host: ``accepted``, ``next_token`` (``r'``), ``active`` before it; ``[B]``."""

    active: list
    accepted: list
    next_token: list

    @property
    def decided(self) -> list:
        """``accepted + 1`` of each row that was active."""
        return [a + 1 for a, on in zip(self.accepted, self.active) if on]

    @property
    def accepted_if_active(self) -> list:
        """``accepted [B]``, None where the row was not active (what the draft server is told)."""
        return [a if on else None for a, on in zip(self.accepted, self.active)]


def commit(
    state: DecodeState, draft_tokens: torch.Tensor, accepted: torch.Tensor, next_token: torch.Tensor
) -> Outcome:
    """Append ``x_1..x_a, r'``, read the outcome (the round's one host sync), count it, set ``draft_feed``."""
    seqs = state.seqs
    active = seqs.host_active  # before this append: from the previous round's read
    with traced(state.recorder, "host", "commit"):
        seqs.append(verification.outcome_tokens(draft_tokens, accepted, next_token), accepted + 1)
        read = count_round(state, Outcome(active, *seqs.read(accepted, next_token)))
    state.draft_feed = draft_feed_after(read, state.k)
    return read


def draft_feed_after(outcome: Outcome, k: int) -> int:
    """``DecodeState.draft_feed`` after ``outcome``: 2 where an active row accepted all ``k``, else 1."""
    return 2 if any(a >= k for a in outcome.accepted_if_active if a is not None) else 1


def count_round(state: DecodeState, outcome: Outcome) -> Outcome:
    """Count a round's ``outcome``, just read, in ``state.counters`` (and the trace); returns it."""
    state.counters.settle()  # the verify's timing events, passed by the device before the read returned
    decided = outcome.decided
    state.counters.accepted_lengths.extend(decided)
    state.counters.rounds += 1
    if state.recorder is not None:
        state.recorder.counter(
            "host", "accepted length", mean=sum(decided) / len(decided) if decided else 0.0
        )
    return outcome


def decode_sd(target: ModelRunner, draft: ModelRunner, state: DecodeState, plan, first_tokens) -> None:
    """Mode ``sd``, every decoder's signature (``plan`` and ``first_tokens`` unused): :func:`sd_rounds`."""
    sd_rounds(target, draft, state)


def sd_rounds(target: ModelRunner, draft: ModelRunner, state: DecodeState, sd_round=None) -> None:
    """``sd_round(target, draft, state) -> Outcome`` until all rows finish (default :func:`fast_sd_round`)."""
    one_round = sd_round or fast_sd_round(target, draft, state)
    while not state.seqs.all_finished():
        with traced(state.recorder, "host", "round", {"round": state.counters.rounds + 1}):
            started = time.perf_counter()
            outcome = one_round(target, draft, state)
            state.counters.end_round(seconds_since(started), outcome.decided)
        state.round_committed()  # streaming: outside the round's clock and slice


def fast_sd_round(target: ModelRunner, draft: ModelRunner, state: DecodeState):
    """This generation's SD round: the graph replay (``sd_graph``) where it captures, else staged."""
    replay = None  # under sampling controls the logits leave the verify's graph
    if in_effect(state) is None:
        replay = graphed_sd_round(target, draft, state, draft_speculation, verify)
    if replay is None:
        return staged_sd_round

    def replayed_sd_round(target: ModelRunner, draft: ModelRunner, state: DecodeState) -> Outcome:
        watch = Stopwatch(state.seqs.tokens.device)
        draft_tokens, accepted, next_token = replay()  # the draft steps and the verify: one graph
        state.counters.time_verify(watch.stop())  # read once commit's read has passed it
        return commit(state, draft_tokens, accepted, next_token)

    return replayed_sd_round


def staged_sd_round(target: ModelRunner, draft: ModelRunner, state: DecodeState) -> Outcome:
    """:func:`draft_speculation` (chained drafting where offered), then :func:`verify_and_commit`."""
    started = time.perf_counter()
    draft_tokens, draft_probs = draft_speculation(draft, state)
    state.counters.draft_s += seconds_since(started)
    return verify_and_commit(target, state, draft_tokens, draft_probs)
