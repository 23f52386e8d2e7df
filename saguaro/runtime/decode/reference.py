"""The reference SD and SSD rounds: one function each, one stage call at a time, on the caller's thread.
The fast paths (graph replay, fused verify-and-commit, chained drafting, SSD's lane) give the same tokens
and KV (``tests/runtime/test_reference_rounds.py``); ``program.decoders = reference_decoders(config)``."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch

from saguaro.core.config import SaguaroConfig
from saguaro.core.errors import ConfigError
from saguaro.core.stages import DRAFT_PREFILL, DRAFT_STEP
from saguaro.runtime.base.model_runner import ModelRunner, elsewhere
from saguaro.runtime.base.state import DecodeState
from saguaro.runtime.base.stats import SOURCES, seconds_since
from saguaro.runtime.base.trace import traced
from saguaro.runtime.decode.ar import decode_ar
from saguaro.runtime.decode.sd import Outcome, commit, sd_rounds, verify
from saguaro.runtime.decode.ssd import count_by_source, count_lookup
from saguaro.runtime.draft.fallback import fast_fallback, neural_fallback
from saguaro.runtime.draft.fan_out import OutcomeEstimator, resolve_fan_out
from saguaro.runtime.draft.records import FAST, HIT, NEURAL, Speculation
from saguaro.runtime.draft.tree import GlueRequest, build_speculations
from saguaro.tensor_math.fork import ranks_from_ranked
from saguaro.tensor_math.verification import uniforms


def reference_sd_round(target: ModelRunner, draft: ModelRunner, state: DecodeState) -> Outcome:
    """One SD round: draft ``k`` tokens, verify them in one target call, accept, commit; the outcome read."""
    seqs, k, t, store = state.seqs, state.k, state.temperature, state.draft_store
    started = time.perf_counter()
    # 1. draft: k calls of one token each after r. The draft's store lacks r, and x_k too after a round
    #    that accepted all k: the first call feeds those n = state.draft_feed tokens
    index = seqs.tail_index(state.draft_feed)  # [B, n]: a token's index is its KV slot
    ids, positions = seqs.gather(index), seqs.positions(index)  # [B, n] x 2
    store.invalidate_from(index[:, 0])  # the draft's KV of the last round's rejected tokens
    stage = DRAFT_STEP.for_temperature(t)
    inv_t = torch.full((), 1.0 / t, device=ids.device) if t > 0 else None
    tokens, probs = [], []
    for _ in range(k):
        if t == 0:
            (token,) = draft.run(stage, store, ids, positions, index)  # [B]: the argmax
            prob = None
        else:
            u = uniforms((seqs.batch,), state.generator, ids.device)  # [B]
            token, prob = draft.run(stage, store, ids, positions, index, inv_t, u)  # [B], q [B, V]
        tokens.append(token)
        probs.append(prob)
        ids, index, positions = token[:, None], index[:, -1:] + 1, positions[:, -1:] + 1  # [B, 1] x 3
    draft_tokens = torch.stack(tokens, dim=1)  # [B, k]
    draft_probs = torch.stack(probs, dim=1) if t > 0 else None  # [B, k, V]
    state.counters.draft_s += seconds_since(started)
    # 2. verify: one target call over [r, x_1..x_k]; greedy, a accepted while x_i is the target's argmax;
    #    sampled, the ratio test min(1, p/q) and the residual draw; r' the recovery (a < k) or bonus token
    accepted, next_token = verify(target, state, draft_tokens, draft_probs)  # [B], [B]
    # 3. accept and 4. commit: x_1..x_a, r' appended to each active row (up to EOS and max_new_tokens), the
    #    outcome read to the host, state.draft_feed set for the next round
    return commit(state, draft_tokens, accepted, next_token)


@dataclass
class DraftSide:
    """What the lane's ``SpeculationServer`` keeps for one SSD generation, held here in plain view."""

    fan_out: object  # config.fan_out: an int, a list or "geometric"
    budget: int
    saguaro_c: float
    fallback: str  # "neural" or "fast"
    generator: torch.Generator | None  # the draft's draws: seeded apart from the target's (GenerateSpec.seed)
    estimator: OutcomeEstimator  # online α and ρ ("geometric")
    layouts: dict = field(default_factory=dict)  # fan-out -> branch layout (GlueRequest.layouts)
    pending_ranks: tuple | None = None  # (accepted, ranks of r') of the last outcome, learned a build later


def reference_ssd_round(
    target: ModelRunner, draft: ModelRunner, state: DecodeState, side: DraftSide, speculation: Speculation
) -> tuple[Outcome, Speculation | None]:
    """One SSD round in turn: fan-out, build, verify, accept and commit, lookup, fallback. Returns the
    outcome read and the next speculation (None once every row has finished)."""
    seqs, k, t, store = state.seqs, state.k, state.temperature, state.draft_store
    # 1. fan-out: F_j branches for outcome position j, from the α and ρ seen so far
    fan_out = resolve_fan_out(side.fan_out, k, side.budget, side.estimator, draft.width)
    # 2. build (the draft lane's work, beside the verify in SSD): glue over [r, x_1..x_k], fork the top-F_j
    #    tokens c of glue row j (x_{j+1} excluded), decode each branch k deep: the cache (j, c) -> k tokens
    index = seqs.forward_index(k + 1)  # [B, k+1]
    ids = torch.cat([seqs.gather(index[:, :1]), speculation.tokens], dim=1)  # [B, k+1]
    glue = GlueRequest(ids, index, seqs.positions(index), fan_out, t, side.saguaro_c, side.layouts)
    cache = build_speculations(draft, store, glue, side.generator)
    if side.pending_ranks is not None:  # the lane learns ρ from the ranks it reads at a build's end
        side.estimator.observe_ranks(*side.pending_ranks)
        side.pending_ranks = None
    # 3. verify and 4. accept and commit, as in SD
    was_active = seqs.active  # [B]
    accepted, next_token = verify(target, state, speculation.tokens, speculation.probs)  # [B], [B]
    outcome = commit(state, speculation.tokens, accepted, next_token)
    count_by_source(state.counters, speculation.source, outcome)
    if seqs.all_finished():
        return outcome, None
    store.invalidate_from(seqs.lengths - 1)  # the draft keeps the glue's r, x_1..x_a; r' is pending
    # α from the draft's own speculations (an n-gram proposal accepts less); ρ from the rank of r' in row a
    looked_up = [(b, a) for b, a in enumerate(outcome.accepted_if_active) if a is not None]
    side.estimator.observe([a for b, a in looked_up if speculation.source[b] != FAST])
    ranks = ranks_from_ranked(cache.ranked, accepted, next_token).tolist()  # [B]
    side.pending_ranks = ([a for _, a in looked_up], [ranks[b] for b, _ in looked_up])
    # 5. lookup: a row that was active hits when the cache holds its outcome (a, r')
    hit, branch = cache.match(accepted, next_token)  # [B], [B]
    hit &= was_active
    tokens, probs = cache.speculation(torch.where(hit, branch, 0))  # [B, k], [B, k, V]
    missed = seqs.active & ~hit  # [B]: active after this round, no cached speculation
    count_lookup(state.counters, (hit & seqs.active).tolist(), outcome.accepted, seqs.host_active)
    source = [HIT if h else NEURAL for h in hit.tolist()]
    # 6. fallback for the rows that missed: neural (the draft decodes k tokens from r' now) or fast (n-gram)
    rows = missed.nonzero()[:, 0]  # [M]
    if rows.numel():
        if side.fallback == "neural":
            fallen, fallen_probs = neural_fallback(draft, store, seqs, rows, k, t, side.generator)
        else:
            fallen, fallen_probs = fast_fallback(seqs, rows, k, draft.spec.vocab_size, t)
        tokens[rows] = fallen
        if probs is not None:
            probs[rows] = fallen_probs
        for b in rows.tolist():
            source[b] = SOURCES.index(side.fallback)
        state.counters.fallbacks[side.fallback] += rows.numel()
    return outcome, Speculation(tokens, probs if t > 0 else None, source)


def decode_sd_reference(target: ModelRunner, draft: ModelRunner, state: DecodeState, plan, first_tokens):
    """Mode ``sd`` by :func:`reference_sd_round` (every decoder's signature)."""
    sd_rounds(target, draft, state, reference_sd_round)


def decode_ssd_reference(target, draft, state: DecodeState, plan, first_tokens, config: SaguaroConfig):
    """Mode ``ssd`` by :func:`reference_ssd_round`, after the draft's prefill and first (neural) speculation;
    ``ConfigError`` for ``"auto"`` fan-out or fallback (decided from measured times) or a draft elsewhere."""
    seqs, spec = state.seqs, plan.spec
    if config.fan_out == "auto" or config.fallback == "auto":
        raise ConfigError(
            f"the reference SSD round takes fan_out as an int, a list or 'geometric' "
            f"(not {config.fan_out!r}) and fallback 'neural' or 'fast' (not {config.fallback!r}): "
            "'auto' decides from measured times"
        )
    if draft is None or elsewhere(target.spec.device, draft.spec.device):
        raise ConfigError("the reference SSD round needs the draft on the target's device, in this process")
    generator = torch.Generator(device=draft.spec.device).manual_seed(spec.seed) if spec.temperature else None
    side = DraftSide(
        config.fan_out,
        config.budget,
        float(config.saguaro_c),
        config.fallback,
        generator,
        OutcomeEstimator(state.k),
    )
    started = time.perf_counter()
    state.draft_store = draft.new_store(seqs.batch, spec.capacity)
    T = seqs.prompt_len
    prompt = torch.arange(T, device=seqs.tokens.device).expand(seqs.batch, T)  # [B, T]
    draft.run(DRAFT_PREFILL, state.draft_store, seqs.tokens[:, :T], seqs.prompt_positions(), prompt)
    every_row = torch.arange(seqs.batch, device=seqs.tokens.device)
    tokens, probs = neural_fallback(
        draft, state.draft_store, seqs, every_row, state.k, state.temperature, generator
    )
    speculation = Speculation(tokens, probs, [NEURAL] * seqs.batch)
    state.counters.draft_s += seconds_since(started)
    while speculation is not None:
        with traced(state.recorder, "host", "round", {"round": state.counters.rounds + 1}):
            started = time.perf_counter()
            outcome, speculation = reference_ssd_round(target, draft, state, side, speculation)
            state.counters.end_round(seconds_since(started), outcome.decided)
        state.round_committed()


def reference_decoders(config: SaguaroConfig) -> dict:
    """``DECODERS`` with SD's and SSD's reference rounds, for ``Program.decoders``."""
    ssd = functools.partial(decode_ssd_reference, config=config)
    return {"ar": decode_ar, "sd": decode_sd_reference, "ssd": ssd}
