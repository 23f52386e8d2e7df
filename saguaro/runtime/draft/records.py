"""What travels between a draft lane's caller and its speculation server: a generation's (or joining
row's) spec, a speculation, a lookup's answer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from saguaro.runtime.base.stats import SOURCES

HIT, NEURAL, FAST = SOURCES.index("hit"), SOURCES.index("neural"), SOURCES.index("fast")


@dataclass
class GenerateSpec:
    """What the draft side needs to mirror one ``generate`` call."""

    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    max_new_tokens: int
    capacity: int
    eos_token_ids: list
    pad_token_id: int
    temperature: float
    seed: int | None
    plan_costs: object = None  # StageCosts measured when the lane warmed up: the planner's starting costs


@dataclass
class Speculation:
    """The speculation of the next round and where each row's came from."""

    tokens: torch.Tensor  # [B, K]
    probs: torch.Tensor | None  # [B, K, V]; None when greedy
    source: list  # [B] host ints, index into SOURCES
    fallback_kind: str | None = None  # the fallback the missed rows took, if any


@dataclass
class Lookup:
    """The cache's answer to an outcome: ``hit [B]`` and the speculation (missed rows hold filler until
    ``fallback`` replaces it)."""

    hit: list  # [B] host bools; False on rows not looked up (finished before this round)
    speculation: Speculation
