"""The benchmark's output: the text table and the JSON report (written atomically)."""

from __future__ import annotations

import json
from pathlib import Path

from saguaro.runtime.base.stats import RAN_AS_SD

BUSY_SPREAD_PCT = 25.0  # a mode's passes spread wider than this: the machine was busy while it ran


def _cell(value, fmt: str, width: int, suffix: str = "") -> str:
    text = f"{value:{fmt}}{suffix}" if value is not None else "-"
    return f"{text:>{width}}"


def row_label(row: dict) -> str:
    """A row's name in the table: an SSD row says when the planner ran its timed generations as SD,
    ``ssd (ran as SD: no tree pays here)`` for all of them, ``ssd (ran as SD: 3/8 calls)`` for some."""
    fraction = row.get("planned_sd_fraction")
    calls = row.get("planned_sd_calls")
    if not fraction:
        return row["mode"]
    if fraction == 1:
        return f"{row['mode']} ({RAN_AS_SD})"
    some = f"{calls[0]}/{calls[1]} calls" if calls else f"{fraction:.0%} of calls"
    return f"{row['mode']} (ran as SD: {some})"


def format_table(rows) -> str:
    """The rows as a text table, each named by :func:`row_label`, :func:`busy_note` under it. The columns are
    docs/bench.md's, and ``decode tok/s``: the tokens after each prefill's first over the seconds after it
    (the rate llama.cpp reports; ``-`` for the ``transformers`` rows)."""
    with_hits = any(r.get("cache_hit_rate") is not None for r in rows)
    with_bytes = any(r.get("weight_bytes_per_token") is not None for r in rows)
    labels = [row_label(r) for r in rows]
    width = max([16] + [len(label) + 2 for label in labels])
    header = (
        f"{'mode':<{width}}{'tokens/s':>10}{'spread':>8}{'decode tok/s':>14}{'accepted len':>14}"
        f"{'vs AR':>8}{'vs SD':>8}"
        f"{'p99 ms/rd':>11}"
    )
    if with_hits:
        header += f"{'cache hits':>12}{'wait ms/rd':>12}{'overlap eff':>13}"
    if with_bytes:
        header += f"{'MB/token':>10}{'GB/s':>8}{'roofline':>10}"
    lines = [header, "-" * len(header)]
    for r, label in zip(rows, labels):
        line = (
            f"{label:<{width}}{r['tokens_per_s']:>10.1f}{_cell(r.get('spread_pct'), '.1f', 8, '%')}"
            f"{_cell(r.get('decode_tokens_per_s'), '.1f', 14)}{_cell(r.get('mean_accepted_len'), '.2f', 14)}"
            f"{_cell(r.get('speedup_vs_ar'), '.2f', 8, 'x')}{_cell(r.get('speedup_vs_sd'), '.2f', 8, 'x')}"
            f"{_cell(r.get('round_ms_p99'), '.1f', 11)}"
        )
        if with_hits:
            line += (
                f"{_cell(r.get('cache_hit_rate'), '.2f', 12)}{_cell(r.get('draft_wait_ms_per_round'), '.2f', 12)}"
                f"{_cell(r.get('overlap_efficiency'), '.2f', 13)}"
            )
        if with_bytes:
            per_token = r.get("weight_bytes_per_token")
            line += (
                f"{_cell(per_token / 1e6 if per_token else None, '.1f', 10)}"
                f"{_cell(r.get('weight_gbs'), '.1f', 8)}{_cell(r.get('roofline_share'), '.2f', 10)}"
            )
        lines.append(line)
    note = busy_note(rows)
    return "\n".join(lines + ([note] if note else []))


def busy_rows(rows) -> list[str]:
    """The labels of the rows whose timed passes spread over :data:`BUSY_SPREAD_PCT` percent."""
    return [row_label(r) for r in rows if (r.get("spread_pct") or 0.0) > BUSY_SPREAD_PCT]


def busy_note(rows) -> str | None:
    """A warning that the machine was busy, naming the rows whose passes spread over
    :data:`BUSY_SPREAD_PCT` percent; None when none did."""
    busy = busy_rows(rows)
    if not busy:
        return None
    worst = max(r.get("spread_pct") or 0.0 for r in rows)
    return (
        f"The machine was busy: the timed passes of {', '.join(busy)} spread over {BUSY_SPREAD_PCT:.0f}% (up to "
        f"{worst:.0f}%), so these speeds and the ratios between modes are not to be trusted; run again on a "
        f"quiet machine, or with more --repeats."
    )


def write_json(report: dict, path) -> Path:
    """Write ``report`` to ``path`` through a temporary file, so a crash never leaves half a report."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(path)
    return path
