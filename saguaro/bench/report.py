"""The benchmark's output: the text table and the JSON report (written atomically)."""

from __future__ import annotations

import json
from pathlib import Path


def _cell(value, fmt: str, width: int, suffix: str = "") -> str:
    text = f"{value:{fmt}}{suffix}" if value is not None else "-"
    return f"{text:>{width}}"


def format_table(rows) -> str:
    """The rows as a text table: tokens/s, mean accepted length, speed-up over AR and over SD, the p99
    time per round, and for SSD rows the cache hit rate, the draft wait per round and the overlap
    efficiency (against the verify alone)."""
    with_hits = any(r.get("cache_hit_rate") is not None for r in rows)
    header = f"{'mode':<16}{'tokens/s':>10}{'accepted len':>14}{'vs AR':>8}{'vs SD':>8}{'p99 ms/rd':>11}"
    if with_hits:
        header += f"{'cache hits':>12}{'wait ms/rd':>12}{'overlap eff':>13}"
    lines = [header, "-" * len(header)]
    for r in rows:
        line = (f"{r['mode']:<16}{r['tokens_per_s']:>10.1f}{_cell(r.get('mean_accepted_len'), '.2f', 14)}"
                f"{_cell(r.get('speedup_vs_ar'), '.2f', 8, 'x')}{_cell(r.get('speedup_vs_sd'), '.2f', 8, 'x')}"
                f"{_cell(r.get('round_ms_p99'), '.1f', 11)}")
        if with_hits:
            line += (f"{_cell(r.get('cache_hit_rate'), '.2f', 12)}{_cell(r.get('draft_wait_ms_per_round'), '.2f', 12)}"
                     f"{_cell(r.get('overlap_efficiency'), '.2f', 13)}")
        lines.append(line)
    return "\n".join(lines)


def write_json(report: dict, path) -> Path:
    """Write ``report`` to ``path`` through a temporary file, so a crash never leaves half a report."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(path)
    return path
