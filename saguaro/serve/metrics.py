"""The server's metrics, written in Prometheus' text exposition format (``GET /metrics``): counters,
gauges and histograms kept under one lock (the scheduler's thread and the event loop both record)."""

from __future__ import annotations

import bisect
import threading

ROUND_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class Histogram:
    def __init__(self, buckets):
        self.buckets, self.counts, self.sum, self.count = tuple(buckets), [0] * len(buckets), 0.0, 0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip(self.buckets, self.counts):
            running += n
            out.append(f'{name}_bucket{{le="{bound}"}} {running}')
        out += [
            f'{name}_bucket{{le="+Inf"}} {self.count}',
            f"{name}_sum {self.sum}",
            f"{name}_count {self.count}",
        ]
        return out


class Metrics:
    """Everything ``/metrics`` shows. ``queue_depth`` and ``running`` are read from the scheduler when written."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[
            str, int
        ] = {}  # by HTTP status ("200", "400", ...), and "cancelled" (client left)
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.accepted_sum = 0.0  # accepted draft tokens over the rounds that verified a speculation
        self.accepted_rounds = 0
        self.cache_hits = 0
        self.cache_lookups = 0
        self.batches = 0
        self.rows_left: dict[str, int] = {}  # rows freed before their end, by why (client gone, stop string)
        self.round_s = Histogram(ROUND_BUCKETS)
        self.ttft_s = Histogram(TTFT_BUCKETS)
        self.batch_rows = Histogram(BATCH_BUCKETS)

    def count_request(self, status) -> None:
        with self.lock:
            self.requests[str(status)] = self.requests.get(str(status), 0) + 1

    def tokens(self, prompt: int, completion: int) -> None:
        with self.lock:
            self.prompt_tokens += prompt
            self.completion_tokens += completion

    def round(self, seconds: float, rows: int) -> None:
        with self.lock:
            self.round_s.observe(seconds)
            self.batch_rows.observe(rows)

    def first_token(self, seconds: float) -> None:
        with self.lock:
            self.ttft_s.observe(seconds)

    def batch_started(self) -> None:
        with self.lock:
            self.batches += 1

    def row_left(self, why: str) -> None:
        with self.lock:
            self.rows_left[why] = self.rows_left.get(why, 0) + 1

    def accepted(self, decided: list) -> None:
        """One speculative round of a running batch: the tokens it decided per row (accepted + 1)."""
        if decided:
            with self.lock:
                self.accepted_sum += sum(decided) / len(decided)
                self.accepted_rounds += 1

    def cache(self, counters) -> None:
        """A batch session's round in mode ``ssd``: its speculation cache's hits and lookups."""
        with self.lock:
            self.cache_hits += counters.hits
            self.cache_lookups += counters.lookups

    def batch_done(self, stats: dict, counters) -> None:
        """A generation's statistics (one that ran to its end): accepted lengths, SSD cache hits."""
        with self.lock:
            rounds = stats.get("rounds", 0)
            if stats.get("mode") != "ar" and rounds:
                self.accepted_sum += stats.get("mean_accepted_len", 0.0) * rounds
                self.accepted_rounds += rounds
            if counters is not None:
                self.cache_hits += getattr(counters, "hits", 0)
                self.cache_lookups += getattr(counters, "lookups", 0)

    def text(self, queue_depth: int, running: int, lane_failures: int) -> str:
        with self.lock:
            lines = ["# TYPE saguaro_requests_total counter"]
            lines += [f'saguaro_requests_total{{status="{s}"}} {n}' for s, n in sorted(self.requests.items())]
            lines += [
                "# TYPE saguaro_prompt_tokens_total counter",
                f"saguaro_prompt_tokens_total {self.prompt_tokens}",
                "# TYPE saguaro_completion_tokens_total counter",
                f"saguaro_completion_tokens_total {self.completion_tokens}",
                "# TYPE saguaro_queue_depth gauge",
                f"saguaro_queue_depth {queue_depth}",
                "# TYPE saguaro_running_requests gauge",
                f"saguaro_running_requests {running}",
                "# TYPE saguaro_batches_total counter",
                f"saguaro_batches_total {self.batches}",
                "# TYPE saguaro_accepted_length_sum counter",
                f"saguaro_accepted_length_sum {self.accepted_sum}",
                "# TYPE saguaro_accepted_length_rounds counter",
                f"saguaro_accepted_length_rounds {self.accepted_rounds}",
                "# TYPE saguaro_mean_accepted_length gauge",
                f"saguaro_mean_accepted_length {self.accepted_sum / max(self.accepted_rounds, 1)}",
                "# TYPE saguaro_ssd_cache_hits_total counter",
                f"saguaro_ssd_cache_hits_total {self.cache_hits}",
                "# TYPE saguaro_ssd_cache_lookups_total counter",
                f"saguaro_ssd_cache_lookups_total {self.cache_lookups}",
                "# TYPE saguaro_ssd_cache_hit_rate gauge",
                f"saguaro_ssd_cache_hit_rate {self.cache_hits / max(self.cache_lookups, 1)}",
                "# TYPE saguaro_draft_lane_failures_total counter",
                f"saguaro_draft_lane_failures_total {lane_failures}",
            ]
            lines += ["# TYPE saguaro_rows_left_early_total counter"]
            lines += [
                f'saguaro_rows_left_early_total{{reason="{r}"}} {n}'
                for r, n in sorted(self.rows_left.items())
            ]
            for name, hist in (
                ("saguaro_round_seconds", self.round_s),
                ("saguaro_ttft_seconds", self.ttft_s),
                ("saguaro_batch_rows", self.batch_rows),
            ):
                lines += [f"# TYPE {name} histogram", *hist.lines(name)]
            return "\n".join(lines) + "\n"
