"""A benchmark row's timed passes, the order they run in, and the row reported from them.

The rows' passes alternate, one pass of each row per round, so a machine whose speed drifts slows every row
alike. A row's ``tokens_per_s`` is its passes' median; every field: docs/bench.md, "JSON".
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from saguaro.runtime.base.stats import percentile


def interleaved(names: list, repeats: int) -> list:
    """The order of the timed passes: every row once per round, in the rows' order, ``repeats`` rounds."""
    return [name for _ in range(repeats) for name in names]


@dataclass
class TimedPass:
    """One timed pass of a row: every batch of prompts generated once."""

    started: float = field(default_factory=time.time)  # epoch seconds: comparable across the rows' processes
    ended: float | None = None
    new_tokens: int = 0
    wall_s: float = 0.0  # the generate calls alone, not the batching between them
    decode_tokens: int = 0  # after each call's prefill
    decode_s: float = 0.0
    accepted: float = 0.0  # sum over calls of (mean accepted length x rounds): per round once divided
    rounds: int = 0
    round_s: list = field(default_factory=list)
    token_s: list = field(default_factory=list)
    ssd: list = field(default_factory=list)  # the stats of the calls that looked up the speculation cache

    def add(self, produced: int, seconds: float, out) -> None:
        """Count one timed call: ``out`` its GenerateOutput (None for a ``transformers`` row)."""
        self.new_tokens += produced
        self.wall_s += seconds
        stats = out.stats if out is not None else {}
        if "prefill_s" in stats:
            rows = out.sequences.shape[0]
            self.decode_tokens += produced - rows
            self.decode_s += seconds - stats["prefill_s"]
        if stats.get("rounds"):
            # weight each call's mean by its rounds, so the row's mean is per round
            self.accepted += stats["mean_accepted_len"] * stats["rounds"]
            self.rounds += stats["rounds"]
            self.round_s += out.counters.round_s
            self.token_s += out.counters.token_s
        if stats.get("cache_hit_rate") is not None:
            self.ssd.append(stats)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens/s after each call's prefill (None for a row without prefill times: ``transformers``)."""
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else None

    def brief(self) -> dict:
        """What a row's process reports of the pass it just ran."""
        return {
            "tokens_per_s": self.tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "started": self.started,
            "ended": self.ended,
        }


def spread_pct(values: list) -> float | None:
    """``(max - min) / median * 100`` of a row's tokens/s over its passes; None with fewer than two."""
    middle = statistics.median(values) if values else 0.0
    return 100 * (max(values) - min(values)) / middle if len(values) > 1 and middle else None


def combine(mode: str, passes: list) -> dict:
    """One row from its timed passes (percentiles and SSD figures pool every call of every pass)."""
    assert passes, f"row {mode} has no timed pass"
    reps = [p.tokens_per_s for p in passes]
    rounds = sum(p.rounds for p in passes)
    round_s = [s for p in passes for s in p.round_s]
    token_s = [s for p in passes for s in p.token_s]
    row = {
        "mode": mode,
        "tokens_per_s": statistics.median(reps),
        "tokens_per_s_reps": reps,
        "spread_pct": spread_pct(reps),
        "repeats": len(passes),
        "decode_tokens_per_s": _median_or_none([p.decode_tokens_per_s for p in passes]),
        "decode_tokens_per_s_reps": [p.decode_tokens_per_s for p in passes],
        "pass_times": [[p.started, p.ended] for p in passes],
        "new_tokens": sum(p.new_tokens for p in passes),
        "wall_s": sum(p.wall_s for p in passes),
        "mean_accepted_len": sum(p.accepted for p in passes) / rounds if rounds else None,
        "rounds": rounds if rounds else None,
        "round_ms_p50": 1000 * percentile(round_s, 50) if round_s else None,
        "round_ms_p99": 1000 * percentile(round_s, 99) if round_s else None,
        "token_ms_p50": 1000 * percentile(token_s, 50) if token_s else None,
        "token_ms_p99": 1000 * percentile(token_s, 99) if token_s else None,
    }
    ssd = [stats for p in passes for stats in p.ssd]
    if ssd:
        row.update(_ssd_summary(ssd, rounds))
    return row


def _median_or_none(values: list):
    return None if not values or None in values else statistics.median(values)


def add_speedups(rows: list, ar: tuple, sd: tuple) -> None:
    """Set every row's ``speedup_vs_ar`` / ``speedup_vs_sd``: its median tokens/s over the first row named in
    ``ar`` / ``sd`` (None without one)."""
    for key, names in (("speedup_vs_ar", ar), ("speedup_vs_sd", sd)):
        base = next((r["tokens_per_s"] for r in rows if r["mode"] in names), None)
        for row in rows:
            row[key] = row["tokens_per_s"] / base if base else None


def _ssd_summary(calls: list[dict], rounds: int) -> dict:
    """SSD columns over all measured calls: hit rate, draft wait per round, overlap efficiency."""
    lookups = sum(c["rounds"] for c in calls)
    mean = lambda key: sum(c[key] * c["rounds"] for c in calls) / lookups if lookups else 0.0
    return {
        "cache_hit_rate": mean("cache_hit_rate"),
        # the timed generations the planner ran as plain SD on every core (sd_when_faster)
        "planned_sd_fraction": sum(bool(c.get("planned_sd")) for c in calls) / len(calls) if calls else None,
        "planned_sd_calls": [sum(bool(c.get("planned_sd")) for c in calls), len(calls)],
        "draft_wait_ms_per_round": 1000 * sum(c["draft_wait_s"] for c in calls) / max(rounds, 1),
        "verify_ms_per_round": 1000 * sum(c["verify_s"] for c in calls) / max(rounds, 1),
        "fallback_ms_per_round": 1000 * sum(c["fallback_s"] for c in calls) / max(rounds, 1),
        "overlap_efficiency": mean("overlap_efficiency"),
        "verify_alone_ms": 1000 * mean("verify_alone_s"),
        "per_round_ms": {
            part: sum(c["per_round_ms"][part] * c["rounds"] for c in calls) / lookups
            for part in calls[0]["per_round_ms"]
        }
        if lookups
        else {},
        "fallbacks": {kind: sum(c["fallbacks"][kind] for c in calls) for kind in ("neural", "fast")},
        "hits_by_position": {
            a: sum(c["hits_by_position"][a] for c in calls) for a in calls[0]["hits_by_position"]
        },
        "accepted_len_on_hits": _weighted(calls, "accepted_len_on_hits"),
        "accepted_len_on_misses": _weighted(calls, "accepted_len_on_misses"),
    }


def _weighted(calls, key):
    values = [(c[key], c["rounds"]) for c in calls if c.get(key) is not None]
    total = sum(w for _, w in values)
    return sum(v * w for v, w in values) / total if total else None
