"""Sampling controls in the rounds (``generate(controls=...)``): each token decided from the distribution
``tensor_math.logits_processing`` makes of the target's, exactly in every mode, with the generator calls and
uniforms of the rounds without controls (``docs/design.md``, "Losslessness").

A grammar (``controls.grammar``) is one more control: each row holds a ``GrammarState`` (``state.grammar_rows``),
advanced by every token the row decides. Each verify position is masked by the row's state after the path's draft
tokens before it (advanced along them, then rolled back), and SD's draft proposes from its own distribution masked
the same way (:func:`draft_under_grammar`), which is then the ``q`` of the ratio test: greedy equals the masked
target's own tokens, and sampling keeps its masked distribution."""

from __future__ import annotations

import logging

import torch

from saguaro.core.errors import ConfigError
from saguaro.core.stages import DRAFT_STEP, TARGET_VERIFY_LOGITS
from saguaro.runtime.base.model_runner import ModelRunner
from saguaro.runtime.base.state import DecodeState
from saguaro.runtime.draft.decode import fresh_columns
from saguaro.tensor_math import logits_processing as lp
from saguaro.tensor_math import verification
from saguaro.tensor_math.grammar import allowed_rows

log = logging.getLogger(__name__)


def in_effect(state: DecodeState) -> lp.SamplingControls | None:
    """``state``'s controls where they change a decision at its temperature, else None."""
    controls = state.controls
    if controls is None or not controls.active:
        return None
    if state.temperature == 0 and not controls.changes_argmax:
        return None
    return controls


def histories(state: DecodeState, vocab_size: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(seen [B, V], output [B, V])``: counts of each row's tokens so far (prompt and output, the pending token
    included) and of its output's alone; ``(None, None)`` when the controls need no history."""
    if not state.controls.needs_history:
        return None, None
    seqs = state.seqs
    steps = torch.arange(seqs.tokens.shape[1], device=seqs.tokens.device)[None, :]  # [1, C]
    held = (steps >= seqs.padding[:, None]) & (steps < seqs.lengths[:, None])  # [B, C]
    seen = lp.token_counts(seqs.tokens, held, vocab_size)
    prompt_end = seqs.prompt_len if state.prompt_ends is None else state.prompt_ends[:, None]  # [] or [B, 1]
    output = lp.token_counts(seqs.tokens, held & (steps >= prompt_end), vocab_size)
    return seen, output


def grammar_rows(state: DecodeState) -> list | None:
    """Each row's ``GrammarState`` under ``state.controls.grammar`` (made at the grammar's start on first use), or
    None without a grammar."""
    grammar = state.controls.grammar if state.controls is not None else None
    if grammar is None:
        return None
    if state.grammar_rows is None:
        state.grammar_rows = [grammar.start() for _ in range(state.seqs.batch)]
    return state.grammar_rows


def advance_rows(rows: list, tokens: list, active: list | None = None) -> None:
    """Advance each row's state by its decided ``tokens[b]`` (a list), rows not ``active`` left alone. A decided
    token is one its mask allowed; where the matcher still refuses it (the library disagreeing with its own mask),
    the row's grammar is abandoned (``GrammarState.abandon``: it ends at its next token) and a warning logged."""
    for b, (row, taken) in enumerate(zip(rows, tokens)):
        if active is not None and not active[b]:
            continue
        for t in taken:
            if row.ended and t not in row.eos:
                break  # past the grammar's end: the row has finished, these tokens are not appended
            if not row.advance(t):
                log.warning(
                    "row %d: token %d was allowed by the grammar's mask but refused by its matcher; "
                    "the row's grammar ends here",
                    b,
                    t,
                )
                row.abandon()
                break


def decide(logits: torch.Tensor, state: DecodeState) -> torch.Tensor:
    """The next token ``[B]`` of each row from the last position's ``logits [B, V]``: under ``state``'s controls
    where they are :func:`in_effect`, else as ``verification.sample_tokens`` decides (the same generator calls)."""
    controls = in_effect(state)
    if controls is None:
        return verification.sample_tokens(logits, state.temperature, state.generator)[0]
    seen, output = histories(state, logits.shape[-1])
    rows = grammar_rows(state)
    allowed = None if rows is None else allowed_rows(rows, logits.device)  # [B, V]
    if state.temperature == 0:
        token = lp.processed_choice(logits, controls, seen, output, allowed)
    else:
        probs = lp.processed_probabilities(
            logits, state.temperature, controls, seen, output, allowed
        )  # [B, V]
        token = verification.draw(probs, state.generator)
    if rows is not None:
        advance_rows(rows, [[t] for t in token.tolist()])
    return token


def verify_controlled(
    target: ModelRunner,
    state: DecodeState,
    ids: torch.Tensor,
    positions: torch.Tensor,
    index: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    controls: lp.SamplingControls,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A verify over ``ids [B, k+1]`` (``[r, x_1..x_k]``) under ``controls``: ``(accepted [B], next [B])``; the
    target's logits leave the graph and each position is processed with its path's tokens before it."""
    if not target.provides(TARGET_VERIFY_LOGITS):
        raise ConfigError(
            "sampling controls need the target's verify_logits stage, which this loaded artifact does "
            "not hold; compile the models with saguaro.compile, or generate with mode='ar'"
        )
    (logits,) = target.run(TARGET_VERIFY_LOGITS, state.target_store, ids, positions, index)  # [B, k+1, V]
    seen, output = histories(state, logits.shape[-1])
    if seen is not None:
        seen, output = lp.path_counts(seen, draft_tokens), lp.path_counts(output, draft_tokens)  # [B, k+1, V]
    rows, allowed = grammar_rows(state), None
    if rows is not None:  # each position's mask: the row's state after the path's draft tokens before it
        drafts, made = draft_tokens.tolist(), state.grammar_masks
        state.grammar_masks = None
        if made is not None and made[0] is draft_tokens:  # the draft's own masks along its tokens
            allowed = made[1].to(ids.device)  # [B, k+1, V]
        else:
            allowed = torch.stack([row.allowed_along(d, ids.device) for row, d in zip(rows, drafts)])
    if state.temperature == 0:
        choice = lp.processed_choice(logits, controls, seen, output, allowed)  # [B, k+1]
        outcome = verification.verify_choice(choice, draft_tokens)
    else:
        if draft_probs is None:
            raise ValueError(
                "draft_probs is required at temperature > 0: verification needs the proposal distribution"
            )
        p = lp.processed_probabilities(
            logits, state.temperature, controls, seen, output, allowed
        )  # [B, k+1, V]
        accept_u, resample_u = verification.verification_uniforms(
            state.seqs.batch, state.k, state.generator, ids.device
        )
        outcome = verification.verify_probabilities(p, draft_tokens, draft_probs, accept_u, resample_u)
    if rows is not None:  # the rows' states move on by the round's decided tokens x_1..x_a, r'
        accepted, next_token = outcome[0].tolist(), outcome[1].tolist()
        decided = [d[:a] + [n] for d, a, n in zip(drafts, accepted, next_token)]
        advance_rows(rows, decided, state.seqs.host_active)
    return outcome


def draft_under_grammar(
    draft: ModelRunner, state: DecodeState, ids: torch.Tensor, index: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """SD's draft under a grammar: ``k`` tokens after ``ids [B, n]`` (the tokens whose draft KV is missing, the
    last being ``r``; slots ``index``, ``positions``), each drawn from the draft's distribution (at the temperature;
    greedy: at 1, its argmax taken) masked by the row's grammar state after the tokens drafted before it and
    renormalised (``logits_processing.masked_distribution``). Returns ``tokens [B, k]`` and, sampled, those masked
    distributions ``[B, k, V]``: the ``q`` verification tests against. The rows' states are left as they were; the
    masks along the tokens (and after the last) go to ``state.grammar_masks``, for the verify of these tokens."""
    rows, store, k, t = grammar_rows(state), state.draft_store, state.k, state.temperature
    store.invalidate_from(index[:, 0])
    ids, index, positions = fresh_columns(
        0, None, ids, index, positions
    )  # SD's one-token feed: a column of [B, 2]
    inv_t = torch.full((), 1.0 / t if t > 0 else 1.0, device=ids.device)  # a fill: no host copy
    u = torch.zeros(ids.shape[0], device=ids.device)  # the stage's own draw is not used
    tokens, probs, masks, taken = [], [], [], [0] * len(rows)
    for _ in range(k):
        _, q = draft.run(DRAFT_STEP.sampled, store, ids, positions, index, inv_t, u)  # [B], [B, V]
        allowed = allowed_rows(rows)  # [B, V] on the CPU
        masks.append(allowed)
        q = lp.masked_distribution(q, allowed.to(q.device))
        if t > 0:  # one uniform a row and a CDF search (a multinomial draws an exponential per token of V)
            u = verification.uniforms((q.shape[0],), state.generator, q.device)  # [B]
            token = verification.sample_inverse_cdf(q, u)  # [B]
        else:
            token = q.argmax(dim=-1)  # [B]
        for b, (row, drafted) in enumerate(zip(rows, token.tolist())):
            taken[b] += row.advance(drafted)
        tokens.append(token)
        probs.append(q)
        ids, index, positions = token[:, None], index[:, -1:] + 1, positions[:, -1:] + 1
    masks.append(allowed_rows(rows))  # after x_k: the bonus position's
    for row, n in zip(rows, taken):
        row.rollback(n)
    drafted = torch.stack(tokens, dim=1)  # [B, k]
    if all(n == k for n in taken):  # every drafted token taken (else the verify walks the path itself)
        state.grammar_masks = (drafted, torch.stack(masks, dim=1))  # [B, k+1, V]
    return drafted, torch.stack(probs, dim=1) if t > 0 else None  # [B, k], [B, k, V]
