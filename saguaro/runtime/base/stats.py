"""What a generation counts, declared once, and the stats dict ``generate`` returns, assembled once."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

SOURCES = ("neural", "fast", "hit")  # codes 0, 1, 2 of where a row's speculation came from
FALLBACK_KINDS = SOURCES[:2]


def seconds_since(started: float) -> float:
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
    prefix_reused: int = 0  # prompt tokens whose KV came from the prefix cache
    verify_s: float = 0.0
    draft_s: float = 0.0
    stream_s: float = 0.0  # in the on_round callback (a streaming consumer): left out of wall_s
    # SSD
    lookups: int = 0
    hits: int = 0
    hits_at: list = field(default_factory=list)  # [k+1]: hits by accepted count a
    fallbacks: dict = field(default_factory=lambda: dict.fromkeys(FALLBACK_KINDS, 0))
    fallback_s: float = 0.0
    draft_wait_s: float = 0.0
    by_source: dict = field(default_factory=lambda: {name: SourceTally() for name in SOURCES})
    lane_failures: int = 0
    verify_alone_s: float = 0.0  # one verify with the draft lane idle (SSD's ideal round)
    round_s: list = field(default_factory=list)  # wall seconds of each round
    token_s: list = field(default_factory=list)  # per active row and round: round seconds / tokens decided
    verify_pending: list = field(default_factory=list)  # verify Intervals (timing.py) not in verify_s yet

    def time_verify(self, interval) -> None:
        """Count a verify call's ``Interval`` into ``verify_s`` once its events completed (never a wait)."""
        self.verify_pending.append(interval)
        self.settle()

    def settle(self) -> None:
        """Fold the verify intervals that are ready into ``verify_s``."""
        while self.verify_pending and self.verify_pending[0].ready():
            self.verify_s += self.verify_pending.pop(0).seconds

    def end_round(self, seconds: float, decided: list) -> None:
        """Record a round that took ``seconds`` and decided ``decided[i]`` tokens for each active row."""
        self.round_s.append(seconds)
        self.token_s.extend(seconds / n for n in decided)

    def __post_init__(self):
        self.hits_at = [0] * (self.k + 1)

    @property
    def mean_accepted_len(self) -> float:
        lengths = self.accepted_lengths
        return sum(lengths) / len(lengths) if lengths else 0.0


RAN_AS_SD = "ran as SD: no tree pays here"  # what every surface says when the planner ran SSD as SD
# ... and when SSD's costs could not be measured yet (compile="background")
RAN_AS_SD_COMPILING = "ran as SD: stages still compiling"


def ran_as_sd(stats: dict) -> str | None:
    """Why an SSD generation ran SD's rounds (:data:`RAN_AS_SD`, :data:`RAN_AS_SD_COMPILING`), or None."""
    if stats.get("planned_sd"):
        return RAN_AS_SD
    if stats.get("mode") == "ssd" and stats.get("ran_as") == "sd":
        return RAN_AS_SD_COMPILING
    return None


def run_label(stats: dict) -> str:
    """The mode in words: ``ssd (ran as SD: ...)`` where :func:`ran_as_sd` says so, else ``stats["mode"]``."""
    why = ran_as_sd(stats)
    return f"{stats['mode']} ({why})" if why else stats["mode"]


def percentile(values: list, q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, nearest rank; 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * len(ordered) + 0.5)) - 1))]


def latency_stats(c: Counters, decode_s: float) -> dict:
    """p50 / p99 of round and token times and the mean round split into verify, draft, waits and host."""
    rounds = max(c.rounds, 1)
    host = decode_s - c.verify_s - c.draft_wait_s - c.fallback_s - c.draft_s
    return {
        "round_ms_p50": 1000 * percentile(c.round_s, 50),
        "round_ms_p99": 1000 * percentile(c.round_s, 99),
        "token_ms_p50": 1000 * percentile(c.token_s, 50),
        "token_ms_p99": 1000 * percentile(c.token_s, 99),
        "per_round_ms": {
            "verify": 1000 * c.verify_s / rounds,
            "draft": 1000 * c.draft_s / rounds,
            "draft_wait": 1000 * c.draft_wait_s / rounds,
            "fallback": 1000 * c.fallback_s / rounds,
            "host": 1000 * max(host, 0.0) / rounds,
        },
    }


def summarize(
    counters: Counters,
    mode: str,
    new_tokens: int,
    batch: int,
    wall: float,
    lane: str | None = None,
    schedule: dict | None = None,
) -> dict:
    """The ``stats`` dict ``generate`` returns (docs/api.md), once every verify interval has completed."""
    c = counters
    c.settle()
    stats = {
        "mode": mode,
        "new_tokens": new_tokens,
        "wall_s": wall,
        "tokens_per_s": new_tokens / wall if wall > 0 else 0.0,
        # after the prefill: the tokens of the rounds over their seconds (llama.cpp's "eval" rate)
        "decode_tokens_per_s": (new_tokens - batch) / (wall - c.prefill_s) if wall > c.prefill_s else 0.0,
        "rounds": c.rounds,
        "mean_accepted_len": c.mean_accepted_len,
        "prefill_s": c.prefill_s,
        "prefix_cached_tokens": c.prefix_reused,
        "verify_s": c.verify_s,
        "draft_s": c.draft_s,
        "stream_s": c.stream_s,  # a streaming reader's time between rounds, left out of wall_s
    } | latency_stats(c, wall - c.prefill_s)
    if mode != "ssd":
        return stats
    # the ideal: every round costs one verify with the draft lane idle (the draft fully hidden)
    ideal = c.mean_accepted_len * batch / c.verify_alone_s if c.verify_alone_s > 0 else 0.0
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
        "verify_alone_s": c.verify_alone_s,
        "overlap_efficiency": stats["tokens_per_s"] / ideal if ideal > 0 else 0.0,
        "lane_failures": c.lane_failures,
        "lane": lane,
        **(schedule or {}),
    }
