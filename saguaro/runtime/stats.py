"""What a generation counts, declared once, and the stats dict ``generate`` returns, assembled once."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

SOURCES = ("neural", "fast", "hit")  # codes 0, 1, 2 of where a row's speculation came from
FALLBACK_KINDS = SOURCES[:2]


def since(started: float) -> float:
    """Seconds from ``started`` (a ``time.perf_counter()`` reading) to now."""
    return time.perf_counter() - started


@dataclass
class SourceTally:
    """Tokens decided (accepted + 1) and rounds, for the rows whose speculation came from one source."""

    tokens: int = 0
    rounds: int = 0

    def mean(self) -> float | None:
        return self.tokens / self.rounds if self.rounds else None


@dataclass
class Counters:
    """Per-generation counters; every mode fills the first group, SSD also the second."""

    k: int
    rounds: int = 0
    accepted_lengths: list = field(default_factory=list)  # tokens per target call, per active row
    prefill_s: float = 0.0
    verify_s: float = 0.0
    draft_s: float = 0.0
    # SSD
    lookups: int = 0
    hits: int = 0
    hits_at: list = field(default_factory=list)  # [k+1]: hits by accepted count a
    fallbacks: dict = field(default_factory=lambda: dict.fromkeys(FALLBACK_KINDS, 0))
    fallback_s: float = 0.0
    draft_wait_s: float = 0.0
    by_source: dict = field(default_factory=lambda: {name: SourceTally() for name in SOURCES})
    lane_failures: int = 0

    def __post_init__(self):
        self.hits_at = [0] * (self.k + 1)

    @property
    def mean_accepted_len(self) -> float:
        lengths = self.accepted_lengths
        return sum(lengths) / len(lengths) if lengths else 0.0


def summarize(counters: Counters, mode: str, new_tokens: int, batch: int, wall: float, lane: str | None = None,
              schedule: dict | None = None) -> dict:
    """The ``stats`` dict of :class:`~saguaro.runtime.program.GenerateOutput` (documented in the README)."""
    c = counters
    stats = {
        "mode": mode,
        "new_tokens": new_tokens,
        "wall_s": wall,
        "tokens_per_s": new_tokens / wall if wall > 0 else 0.0,
        "rounds": c.rounds,
        "mean_accepted_len": c.mean_accepted_len,
        "prefill_s": c.prefill_s,
        "verify_s": c.verify_s,
        "draft_s": c.draft_s,
    }
    if mode != "ssd":
        return stats
    mean_verify = c.verify_s / c.rounds if c.rounds else 0.0
    ideal = c.mean_accepted_len * batch / mean_verify if mean_verify > 0 else 0.0  # tokens/s, draft fully hidden
    misses = [c.by_source[name] for name in FALLBACK_KINDS]
    missed = SourceTally(sum(t.tokens for t in misses), sum(t.rounds for t in misses))
    return stats | {
        "cache_hit_rate": c.hits / c.lookups if c.lookups else 0.0,
        "hits_by_position": dict(enumerate(c.hits_at)),
        "accepted_len_on_hits": c.by_source["hit"].mean(),
        "accepted_len_on_misses": missed.mean(),
        "fallbacks": dict(c.fallbacks),
        "draft_wait_s": c.draft_wait_s,
        "fallback_s": c.fallback_s,
        "overlap_efficiency": stats["tokens_per_s"] / ideal if ideal > 0 else 0.0,
        "lane_failures": c.lane_failures,
        "lane": lane,
        **(schedule or {}),
    }
