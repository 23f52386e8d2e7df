"""State shared by the decoding modes within one ``generate`` call."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from saguaro.runtime.base.kv_store import KVStore
from saguaro.runtime.base.sequences import SequenceBatch
from saguaro.runtime.base.stats import Counters


@dataclass
class DecodeState:
    """Everything one ``generate`` call mutates."""

    seqs: SequenceBatch
    target_store: KVStore
    draft_store: KVStore | None
    temperature: float
    generator: torch.Generator | None
    k: int
    recorder: object = None  # a runtime.trace.TraceRecorder when this generate is traced
    counters: Counters = field(init=False)

    def __post_init__(self):
        self.counters = Counters(self.k)
