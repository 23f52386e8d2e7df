"""The draft's own decoding, ``k`` autoregressive steps (SD drafting, the neural fallback); greedy by the
chained step (:data:`~saguaro.core.stages.DRAFT_CHAIN`) where the builder offers it."""

from __future__ import annotations

import torch

from saguaro.core.stages import DRAFT_CHAIN, DRAFT_STEP
from saguaro.runtime.base.kv_store import KVStore
from saguaro.runtime.base.model_runner import ModelRunner
from saguaro.tensor_math.verification import uniforms

CATCH_UP = "catch-up"  # a trace's name for a step whose output is unused (the KV of a token before the last)


def draft_decode(
    draft: ModelRunner,
    store: KVStore,
    ids: torch.Tensor,  # [B, n]: tokens whose draft KV is missing, the last one being r
    index: torch.Tensor,  # [B, n]: their slots (token indices)
    positions: torch.Tensor,  # [B, n]
    k: int,
    temperature: float,
    generator,  # a torch.Generator, None, or one per row (a list)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode ``k`` tokens after ``ids``: ``tokens [B, k]`` and, sampled, the distributions ``[B, k, V]``
    drawn from (None when greedy). The fed tokens before the last only write their KV: sampled they go
    in one call with it (one uniform per row, as every step), greedy too where :func:`feeds_together`."""
    store.invalidate_from(index[:, 0])
    if temperature == 0 and draft.provides(DRAFT_CHAIN):
        return chained_steps(draft, store, ids, index, positions, k), None
    stage = DRAFT_STEP.for_temperature(temperature)
    tokens, probs = [], []
    inv_t = (
        torch.full((), 1.0 / temperature, device=ids.device) if temperature > 0 else None
    )  # a fill: no sync
    if inv_t is None and not feeds_together(draft, stage):
        for j in range(ids.shape[1] - 1):  # [B, 1] each, contiguous as the later steps' inputs are
            draft.run(stage, store, *fresh_columns(j, j + 1, ids, positions, index), note=CATCH_UP)
        ids, positions, index = fresh_columns(-1, None, ids, positions, index)  # [B, 1] x 3
    else:  # [B, n] x 3 fed at once, freshly strided (SD's one-token feed is a column of its [B, 2] inputs)
        ids, positions, index = fresh_columns(0, None, ids, positions, index)
    for _ in range(k):
        if inv_t is None:
            (token,) = draft.run(stage, store, ids, positions, index)  # [B]
            prob = None
        else:
            u = uniforms((ids.shape[0],), generator, ids.device)  # [B]: per row with one generator per row
            token, prob = draft.run(stage, store, ids, positions, index, inv_t, u)  # [B], [B, V]
        tokens.append(token)
        probs.append(prob)
        ids, index, positions = token[:, None], index[:, -1:] + 1, positions[:, -1:] + 1
    stacked_probs = torch.stack(probs, dim=1) if probs[0] is not None else None  # [B, k, V]
    return torch.stack(tokens, dim=1), stacked_probs  # [B, k]


def chained_steps(
    draft: ModelRunner,
    store: KVStore,
    ids: torch.Tensor,  # [B, n]: tokens whose draft KV is missing, the last one being r
    index: torch.Tensor,  # [B, n]: their slots, consecutive
    positions: torch.Tensor,  # [B, n]: consecutive
    k: int,
) -> torch.Tensor:
    """Greedy drafting by :data:`~saguaro.core.stages.DRAFT_CHAIN`: ``tokens [B, k]``, those of the plain
    step. Each call writes its tokens' KV and claims the next query's slot, so no host work runs between
    steps; the slot claimed for ``x_k``, which no call writes, is dropped again."""
    together = feeds_together(draft, DRAFT_CHAIN)
    columns = [(0, None)] if together else [(j, j + 1) for j in range(ids.shape[1])]
    query = fresh_columns(*columns[0], ids, positions, index)  # input_ids, positions, write_slots [B, n or 1]
    branches: dict = {}  # query width -> [B, width] zeros: shared
    # each query width's fast call (ModelRunner.make_query_call): an earlier round's on this store,
    # else made after the first call of that width
    repeats: dict = {}
    first = True  # the first call's slots are claimed here or by the runner, the others' by the call before

    def call(query: tuple, note: str | None = None) -> tuple:
        nonlocal first
        width = query[0].shape[1]
        branch = branches.setdefault(width, torch.zeros_like(query[1]))
        if width not in repeats:
            repeats[width] = draft.kept_query_call(DRAFT_CHAIN, store, width)
        out = None
        if (repeat := repeats[width]) is not None:
            if first:
                store.claim(query[2], query[1], branch)
            out = repeat(*query, branch)
        if out is None:
            out = draft.run(DRAFT_CHAIN, store, *query, branch=branch, note=note, claimed=not first)
            if repeat is None:
                repeats[width] = draft.make_query_call(DRAFT_CHAIN, store, *query, branch) or (
                    lambda *_: None
                )
        first = False
        return out

    for j, end in columns[1:]:
        _, _, next_positions, next_slots = call(query, CATCH_UP)
        query = (*fresh_columns(j, end, ids), next_positions, next_slots)
    tokens = []
    for _ in range(k):
        token, *query = call(query)  # [B], [B, 1] x 3
        tokens.append(token)
    store.invalidate_from(query[2][:, 0])
    return torch.stack(tokens, dim=1)  # [B, k]


def feeds_together(draft: ModelRunner, stage) -> bool:
    """Whether a round's fed tokens go to ``stage`` in one call: not where its linears are Inductor's
    reductions (two rows read each weight twice) or unknown (a loaded artifact's), see
    docs/measurements/2026-12-06-prefill-and-draft-feed.md."""
    linears_of = getattr(draft.build, "linears_of", None)
    return linears_of is not None and linears_of(stage) != "reduction"


def fresh_columns(start: int, end: int | None, *tensors: torch.Tensor) -> tuple:
    """Columns ``start:end`` of each ``[B, n]`` tensor, freshly strided, so that every call of a query width
    matches one compiled graph's guards."""
    return tuple(t[:, start:end].clone(memory_format=torch.contiguous_format) for t in tensors)
