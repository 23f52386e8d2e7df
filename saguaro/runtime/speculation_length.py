"""How many tokens a batch session's SD round drafts: the ``k`` whose rounds are expected to decide the most tokens
a second at the batch's size, from the rounds' own measured times and acceptance.

``SpeculationLength(k_max)``: :meth:`choose` gives a ``k`` in ``1..k_max`` for a batch of ``B`` rows, and
:meth:`observe` takes what that round did: its wall seconds and the tokens each active row gained (accepted + 1,
fewer where the row ended inside the round: what a round is worth is what its rows hand out).
Two estimates feed the choice:

- the acceptance at each draft position ``j``: the share of rows that, having accepted tokens ``1..j-1``, accept
  token ``j``, pooled over every round and row (a row that accepted ``a`` of ``k`` passes positions ``1..a`` and,
  where ``a < k``, fails ``a + 1``; a position's older rounds fade by :data:`MEMORY` as new ones come, and one
  seldom reached leans on the position before it), so a row
  is expected to decide ``1 + sum_j prod_{i <= j} alpha_i`` tokens a round at ``k`` (whatever ties one
  position's acceptance to the last: the shares are conditional);
- a round's seconds at each ``k``, per batch-size bucket (1, 2, 3-4, 5-8, ...): first measured
  (:data:`FIRST_ROUNDS` rounds each, ``k_max`` first, the quickest kept: a first call may compile), then
  averaged (:data:`SMOOTHING`, a round counted as at most :data:`OUTLIER` times the average; a remeasurement
  below its average replaces it, so a k measured slow once, or that became cheaper, is found again at once).

A bucket runs the best expected ``B`` tokens a second, and remeasures one other ``k`` (each in turn) one round in
every :data:`EXPLORE_EVERY`, so the choice follows the machine's load. Nothing is tuned to a machine: the costs are the
rounds' own. Why: a batch's verify grows with ``B (k + 1)`` tokens, and where the target is compute-bound at that
size a shorter speculation wins (docs/measurements/2026-12-07-speculation-length.md).

Invariant: any ``k`` is exact (greedy rounds give the same tokens; sampled rounds the same distribution), so the
choice changes speed only. A seeded sampled row's tokens depend on ``k``; sessions holding one run ``k_max``
(``runtime/batching.py``).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

FIRST_ROUNDS = 3  # rounds each k is measured first in a bucket
EXPLORE_EVERY = 24  # rounds of a bucket between two remeasurements of a k other than its best
SMOOTHING = 0.25  # weight of a new round in a k's averaged seconds
OUTLIER = 3.0  # a round is counted as at most this many times its k's average (a stall, a compile)
MEMORY = 0.98  # the weight a position's counts keep at each round that reaches it (about the last 50)
PRIOR_WEIGHT = (
    2.0  # rows' worth of the position before's acceptance (position 1's: 0.5) a position starts with
)


class SpeculationLength:
    """The measured choice of ``k`` per batch-size bucket (see the module's docstring)."""

    def __init__(self, k_max: int):
        if isinstance(k_max, bool) or not isinstance(k_max, int) or k_max < 1:
            raise ValueError(f"k_max={k_max!r} is not allowed: it must be an integer >= 1")
        self.k_max = k_max
        self.passed = [0.0] * k_max  # per draft position 1..k_max: rows that accepted it ...
        self.failed = [0.0] * k_max  # ... and rows that reached it and did not
        self._buckets: dict = {}  # bucket -> _Bucket

    def acceptance(self) -> list:
        """The estimated acceptance at each draft position ``1..k_max``, given the ones before accepted; a position
        seldom reached leans on the one before it (:data:`PRIOR_WEIGHT`)."""
        shares, before = [], 0.5
        for passed, failed in zip(self.passed, self.failed):
            before = (passed + PRIOR_WEIGHT * before) / (passed + failed + PRIOR_WEIGHT)
            shares.append(before)
        return shares

    def expected_tokens(self, k: int) -> float:
        """Tokens a row is expected to decide in a round at ``k``."""
        tokens, reach = 1.0, 1.0
        for alpha in self.acceptance()[:k]:
            reach *= alpha
            tokens += reach
        return tokens

    def choose(self, batch: int) -> int:
        """The ``k`` for the next round of ``batch`` rows (``batch`` >= 1)."""
        bucket = self._bucket(batch)
        for k in range(self.k_max, 0, -1):
            if bucket.rounds.get(k, 0) < FIRST_ROUNDS:
                return k
        rates = self.rates(batch)
        best = max(rates, key=lambda k: (rates[k], k))
        if best != bucket.best:
            log.debug(
                "batches of %d rows: k %s -> %d (expected tokens/s %s)", batch, bucket.best, best, rates
            )
            bucket.best = best
        bucket.since_explore += 1
        if bucket.since_explore < EXPLORE_EVERY or self.k_max == 1:
            return best
        bucket.since_explore = 0
        others = [k for k in range(1, self.k_max + 1) if k != best]
        bucket.exploring = others[bucket.explored % len(others)]
        bucket.explored += 1
        return bucket.exploring

    def observe(self, batch: int, k: int, seconds: float, gained: list) -> None:
        """A round of ``batch`` rows at ``k`` took ``seconds``; ``gained``: each active row's tokens (1..k+1; a row
        that ended at its ``g``-th token counts as failing position ``g``)."""
        if not 1 <= k <= self.k_max:
            return
        accepted = [min(max(g - 1, 0), k) for g in gained]
        for j in range(k):  # position j + 1: rows that reached it (accepted j) passed or failed it
            passed = sum(a > j for a in accepted)
            failed = sum(a == j for a in accepted)
            if passed or failed:
                self.passed[j] = MEMORY * self.passed[j] + passed
                self.failed[j] = MEMORY * self.failed[j] + failed
        if seconds > 0:
            self._bucket(batch).observe(k, seconds)

    def rates(self, batch: int) -> dict:
        """``{k: expected tokens a second}`` of ``batch`` rows, for each ``k`` measured in its bucket."""
        seconds = self._bucket(batch).seconds
        return {k: batch * self.expected_tokens(k) / s for k, s in seconds.items()}

    def _bucket(self, batch: int) -> _Bucket:
        key = max(batch - 1, 0).bit_length()  # 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ...
        if key not in self._buckets:
            self._buckets[key] = _Bucket()
        return self._buckets[key]


class _Bucket:
    """One batch-size bucket's measured round seconds per ``k``."""

    def __init__(self):
        self.seconds: dict = {}  # k -> a round's seconds
        self.rounds: dict = {}  # k -> rounds observed
        self.since_explore = 0
        self.explored = 0  # remeasurements so far: the next one takes the next other k
        self.exploring = None  # the k the last choice remeasured
        self.best = None  # the k it runs

    def observe(self, k: int, seconds: float) -> None:
        rounds = self.rounds.get(k, 0)
        if not rounds:
            self.seconds[k] = seconds
        elif rounds < FIRST_ROUNDS:  # the quickest of the first rounds
            self.seconds[k] = min(self.seconds[k], seconds)
        elif k == self.exploring and seconds < self.seconds[k]:  # measured once in a while: taken at once
            self.seconds[k] = seconds
        else:
            seconds = min(seconds, OUTLIER * self.seconds[k])
            self.seconds[k] += SMOOTHING * (seconds - self.seconds[k])
        self.exploring = None
        self.rounds[k] = rounds + 1
