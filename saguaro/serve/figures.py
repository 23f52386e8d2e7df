"""A request's own speculation figures, ``usage["saguaro"]`` of its answer (as llama-server's ``timings``): what
the rounds of each of its choices decided, counted by the scheduler as they run, combined over its choices.

Only figures known per request are given, never a batch's shared ones passed off as a row's: ``rounds`` (the
rounds its rows took part in, after the prefill), ``mean_accepted_length`` (tokens decided per round, accepted
+ 1, as ``generate``'s ``stats["mean_accepted_len"]``; 1 in mode ``ar``), and in mode ``ssd``
``cache_hit_rate`` (the share of its rows' speculation-cache lookups that hit), left out where a round's hits
could not be told row by row."""

from __future__ import annotations

from dataclasses import dataclass, field

from saguaro.runtime.base.stats import SOURCES

HIT = SOURCES.index("hit")  # a speculation's source code where it came from the speculation cache


@dataclass
class Figures:
    """One choice's figures. ``mode``: the program's (what was asked); ``ran_as``: the rounds its batch ran."""

    mode: str | None
    ran_as: set = field(default_factory=set)
    rounds: int = 0
    decided: int = 0  # tokens decided over the rounds that told them
    decided_rounds: int = 0
    lookups: int = 0
    hits: int = 0
    hits_known: bool = True
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache

    def round(self, ran_as: str, decided: int | None, lookup: tuple | None) -> None:
        """One round of the choice's row: ``decided`` tokens (None: not told), ``lookup`` ``(looked up, hit)``
        in the speculation cache (None: not told row by row)."""
        self.ran_as.add(ran_as)
        self.rounds += 1
        if decided is not None:
            self.decided += decided
            self.decided_rounds += 1
        if ran_as == "ssd":
            if lookup is None:
                self.hits_known = False
            else:
                self.lookups += int(lookup[0])
                self.hits += int(lookup[0] and lookup[1])

    def generation(self, ran_as: str, counters) -> None:
        """A generation of the choice alone (``program.stream``): its ``Counters``."""
        self.ran_as.add(ran_as)
        self.rounds += counters.rounds
        self.decided += sum(counters.accepted_lengths)
        self.decided_rounds += len(counters.accepted_lengths)
        self.lookups += counters.lookups
        self.hits += counters.hits
        self.cached_tokens = max(self.cached_tokens, counters.prefix_reused)


def combined(figures: list) -> dict:
    """``usage["saguaro"]`` of a request from its choices' :class:`Figures`: ``mode``, ``ran_as`` (the runs of
    its rounds, comma-separated where they differed), ``rounds`` (summed), ``mean_accepted_length`` (over all
    their rounds) and, in mode ``ssd`` where every lookup was told, ``cache_hit_rate``."""
    if not figures:
        return {}
    ran_as = sorted(set().union(*(f.ran_as for f in figures)))
    out = {
        "mode": figures[0].mode,
        "ran_as": ",".join(ran_as) if ran_as else None,
        "rounds": sum(f.rounds for f in figures),
    }
    decided_rounds = sum(f.decided_rounds for f in figures)
    if decided_rounds:
        out["mean_accepted_length"] = sum(f.decided for f in figures) / decided_rounds
    lookups = sum(f.lookups for f in figures)
    if "ssd" in ran_as and lookups and all(f.hits_known for f in figures):
        out["cache_hit_rate"] = sum(f.hits for f in figures) / lookups
    return out
