"""State shared by the decoding modes within one ``generate`` call."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from saguaro.runtime.kv_store import KVStore
from saguaro.runtime.sequences import SequenceBatch


@dataclass
class Timers:
    """Seconds spent per kind of work, and counters the stats report."""

    seconds: dict = field(default_factory=dict)
    counts: dict = field(default_factory=dict)

    @contextmanager
    def time(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def count(self, name: str, amount: float = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + amount


@dataclass
class DecodeState:
    """Everything one ``generate`` call mutates."""

    seqs: SequenceBatch
    target_store: KVStore
    draft_store: KVStore | None
    temperature: float
    generator: torch.Generator | None
    k: int
    timers: Timers = field(default_factory=Timers)
    accepted_lengths: list = field(default_factory=list)  # tokens per target call, per active row
