"""Checks of a benchmark's timed passes, shared by the ``saguaro bench`` and demo tests."""

import statistics

import pytest


def table_column(out: str, name: str, count: int) -> list[str]:
    """The cells under the right-aligned header ``name`` of the first ``count`` rows of the table in ``out``."""
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("mode "))
    end = lines[at].index(name) + len(name)
    return [line[:end].split()[-1] for line in lines[at + 2 : at + 2 + count]]


def check_timed_passes(rows: list[dict], repeats: int, out: str) -> None:
    """Every row ran ``repeats`` timed passes; the rows' passes alternated (one of each row per round, in
    the rows' order) and never overlapped; ``tokens_per_s`` is the median of the passes, ``spread_pct``
    their (max - min) / median, and the table's spread column shows it. No assertion on speed."""
    passes = sorted((start, end, row["mode"]) for row in rows for start, end in row["pass_times"])
    assert [mode for _, _, mode in passes] == [row["mode"] for row in rows] * repeats
    assert all(end <= next_start for (_, end, _), (next_start, _, _) in zip(passes, passes[1:])), passes
    for row in rows:
        reps = row["tokens_per_s_reps"]
        assert row["repeats"] == len(reps) == repeats, row
        assert row["tokens_per_s"] == statistics.median(reps), row
        assert row["spread_pct"] == pytest.approx(100 * (max(reps) - min(reps)) / statistics.median(reps)), (
            row
        )
    assert table_column(out, "spread", len(rows)) == [f"{row['spread_pct']:.1f}%" for row in rows]
    # the rate after the prefill: each Saguaro row's median over its passes; "-" where a row has none
    decode = [row.get("decode_tokens_per_s") for row in rows]
    assert table_column(out, "decode tok/s", len(rows)) == ["-" if d is None else f"{d:.1f}" for d in decode]
    assert any(d is not None and d > 0 for d in decode), rows
