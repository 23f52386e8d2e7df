"""State shared by the decoding modes within one ``generate`` call."""

from __future__ import annotations

import time
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
    on_round: object = None  # called with ``seqs`` once a round's tokens are committed (streaming)
    controls: object = None  # a tensor_math.logits_processing.SamplingControls, or None (runtime/decode/controlled.py)
    counters: Counters = field(init=False)
    # the tokens the next draft call feeds each row: 2 (the pending token and the one before it, whose draft
    # KV is missing when the last round accepted all k draft tokens) unless the last round's outcome showed
    # every active row accepted fewer than k, when the draft holds the one before and 1 suffices
    draft_feed: int = field(init=False, default=2)

    def __post_init__(self):
        self.counters = Counters(self.k)

    def round_committed(self) -> None:
        """Every decoder calls this after a round appended its tokens and stopped its clock (the prefill
        after the first token): hands the sequences to ``on_round`` when streaming. The time spent there
        (the consumer's, not the decoder's) goes to ``counters.stream_s``, which ``wall_s`` leaves out."""
        if self.on_round is not None:
            started = time.perf_counter()
            self.on_round(self.seqs)
            self.counters.stream_s += time.perf_counter() - started
