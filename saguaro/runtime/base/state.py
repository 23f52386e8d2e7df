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
    controls: object = None  # a SamplingControls, or None (runtime/decode/controlled.py)
    grammar_rows: list | None = None  # each row's GrammarState under controls.grammar (controlled.py)
    grammar_masks: tuple | None = None  # (draft tokens [B, k], their path's masks [B, k+1, V]) the draft made
    # [B] each row's first output column (a batch session's rows); None: every row's is seqs.prompt_len
    prompt_ends: torch.Tensor | None = None
    prefix_cache: object = (
        None  # a runtime.base.prefix_cache.PrefixCache the prefill reuses and fills, or None
    )
    counters: Counters = field(init=False)
    # tokens the next draft call feeds each row: 2 (the pending token and the one before, whose draft KV
    # is missing after a round that accepted all k), or 1 when every active row of the last round
    # accepted fewer than k
    draft_feed: int = field(init=False, default=2)

    def __post_init__(self):
        self.counters = Counters(self.k)

    def round_committed(self) -> None:
        """After a round appended its tokens and stopped its clock: hand ``seqs`` to ``on_round`` when
        streaming, the time it takes going to ``counters.stream_s``, which ``wall_s`` leaves out."""
        if self.on_round is not None:
            started = time.perf_counter()
            self.on_round(self.seqs)
            self.counters.stream_s += time.perf_counter() - started
