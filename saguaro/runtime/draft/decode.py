"""The draft's own decoding: ``k`` autoregressive steps (SD drafting and the neural fallback)."""

from __future__ import annotations

import torch

from saguaro.core.stages import DRAFT_PREFILL, DRAFT_STEP
from saguaro.runtime.base.kv_store import KVStore
from saguaro.runtime.base.model_runner import ModelRunner


def draft_decode(
    draft: ModelRunner,
    store: KVStore,
    ids: torch.Tensor,  # [B, n]: tokens whose draft KV is missing, the last one being r
    index: torch.Tensor,  # [B, n]: their slots (token indices)
    positions: torch.Tensor,  # [B, n]
    k: int,
    temperature: float,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode ``k`` tokens after ``ids``: ``tokens [B, k]`` and the distributions drawn from ``[B, k, V]``.

    A first call of several tokens (the round's catch-up) runs the draft's prefill graph, whose query
    length is dynamic, and the step's epilogue after it, here: the step's graph then only ever sees one
    token, so it compiles once (dynamo specialises a length of 1, so a 2-token step was a second compile).
    """
    store.invalidate_from(index[:, 0])
    stage = DRAFT_STEP.at(temperature)
    tokens, probs = [], []
    inv_t = torch.full((), 1.0 / temperature, device=ids.device) if temperature > 0 else None  # a fill: no sync
    for _ in range(k):
        extra = () if inv_t is None else (inv_t, torch.rand(ids.shape[0], generator=generator, device=ids.device))
        if ids.shape[1] > 1:
            (logits,) = draft.run(DRAFT_PREFILL, store, ids, positions, index)  # [B, V]: the last token's
            out = stage.epilogue_function(logits[:, None], *extra)  # what the step's graph returns after them
            out = out if isinstance(out, tuple) else (out,)
        else:
            out = draft.run(stage, store, ids, positions, index, *extra)
        token, prob = (out[0], None) if inv_t is None else out  # [B], [B, V]
        tokens.append(token)
        probs.append(prob)
        ids, index, positions = token[:, None], index[:, -1:] + 1, positions[:, -1:] + 1
    stacked_probs = torch.stack(probs, dim=1) if probs[0] is not None else None  # [B, k, V]
    return torch.stack(tokens, dim=1), stacked_probs  # [B, k]
