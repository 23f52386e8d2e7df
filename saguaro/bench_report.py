"""The benchmark's output: the text table and the JSON report (written atomically)."""

from __future__ import annotations

import json
from pathlib import Path


def format_table(rows) -> str:
    """The rows as a text table: tokens/s, mean accepted length, speed-up over AR, and for SSD rows the
    cache hit rate, the draft wait per round and the overlap efficiency."""
    with_hits = any(r.get("cache_hit_rate") is not None for r in rows)
    header = f"{'mode':<14}{'tokens/s':>10}{'accepted len':>14}{'speed-up vs AR':>16}"
    if with_hits:
        header += f"{'cache hits':>12}{'wait ms/rd':>12}{'overlap eff':>13}"
    lines = [header, "-" * len(header)]
    for r in rows:
        acc = f"{r['mean_accepted_len']:.2f}" if r["mean_accepted_len"] is not None else "-"
        sp = f"{r['speedup_vs_ar']:.2f}x" if r.get("speedup_vs_ar") is not None else "-"
        line = f"{r['mode']:<14}{r['tokens_per_s']:>10.1f}{acc:>14}{sp:>16}"
        if with_hits:
            if r.get("cache_hit_rate") is not None:
                line += (f"{r['cache_hit_rate']:>12.2f}{r['draft_wait_ms_per_round']:>12.2f}"
                         f"{r['overlap_efficiency']:>13.2f}")
            else:
                line += f"{'-':>12}{'-':>12}{'-':>13}"
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
