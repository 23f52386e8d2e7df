"""Costs measured before a generation: the target's verify alone, with the draft lane idle.

SSD's ideal is a round that costs the verify alone, so ``overlap_efficiency`` is measured against
it. During SSD rounds the verify shares the machine with the draft lane and slows down, so it is
timed here, on a scratch store, before the lane starts working.
"""

from __future__ import annotations

import time

import torch

from saguaro.core.stages import TARGET_VERIFY
from saguaro.runtime.model_runner import ModelRunner

REPEATS = 3


@torch.inference_mode()
def time_verify_alone(target: ModelRunner, batch: int, capacity: int, k: int, temperature: float,
                      vocab_size: int, repeats: int = REPEATS) -> float:
    """Seconds of one ``target.verify`` call at this batch, store capacity and temperature (the least of
    ``repeats`` calls: the machine's own noise only ever adds time)."""
    device = target.spec.device
    store = target.new_store(batch, capacity)
    index = torch.arange(k + 1, device=device).expand(batch, k + 1)  # [B, k+1]
    ids = torch.zeros(batch, k + 1, dtype=torch.long, device=device)
    draft_tokens = ids[:, 1:]  # [B, k]
    stage = TARGET_VERIFY.at(temperature)
    extra = (draft_tokens,)
    if temperature > 0:
        probs = torch.full((batch, k, vocab_size), 1.0 / vocab_size, device=device)  # [B, k, V]
        uniforms = torch.full((batch, k + 1), 0.5, device=device)
        extra = (draft_tokens, probs, torch.tensor(1.0 / temperature, device=device), uniforms[:, :k],
                 uniforms[:, k])
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        target.run(stage, store, ids, index, index, *extra)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best
