"""The probe's report (``gpu_probe.json``): how it is written, its summary, and the tables printed last."""

from __future__ import annotations

import json
from pathlib import Path

PARTS = ("A", "B", "C", "D", "E")


class Report:
    """``gpu_probe.json``, read and rewritten whole at every update (one writer at a time: the parent
    waits for its child), written to a temporary file and renamed, so it is never half-written."""

    def __init__(self, path: Path):
        self.path = path

    def load(self) -> dict:
        return json.loads(self.path.read_text()) if self.path.exists() else {}

    def update(self, keys: tuple, data: dict) -> None:
        report = self.load()
        node = report
        for key in keys:
            node = node.setdefault(key, {})
        node.update(data)
        report["summary"] = summarize(report)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=2, default=str))
        tmp.replace(self.path)


def summarize(report: dict) -> dict:
    """Exactness over every check that ran (part D), and each part's status."""
    parts = report.get("parts", {})
    subphases = parts.get("D", {}).get("subphases", {})
    checks, errors = [], []
    for sub, data in subphases.items():
        checks += [dict(c, subphase=sub) for c in data.get("checks", [])]
        if str(data.get("status", "")).startswith(("error", "terminated")):
            errors.append(sub)
    failed = [f"{c['subphase']}/{c['name']}" for c in checks if c.get("ok") is False]
    ran = any(not str(d.get("status", "")).startswith("skipped") for d in subphases.values())
    return {  # None: exactness was not asked for
        "exactness_all_true": (bool(checks) and not failed and not errors) if ran else None,
        "exactness_checks": len(checks),
        "exactness_failed": failed,
        "exactness_subphase_errors": errors,
        "status": {p: parts[p].get("status") for p in PARTS if p in parts},
    }


def _f(value, digits=1) -> str:
    return "-" if value is None else (f"{value:.{digits}f}" if isinstance(value, float) else str(value))


def _launches(row: dict) -> str:
    counts = row.get("launches_per_stage") or {}
    return "/".join(str(n) for n in counts.values()) if counts else "-"


def rows_table(rows: list) -> list:
    lines = [
        f"  {'row':<16}{'batch':>5}{'tok/s':>9}{'ms/round':>9}{'acc.len':>8}{'roofline':>9}{'syncs':>6}"
        f"{'hit':>6}  launches per stage"
    ]
    for r in rows:
        lines.append(
            f"  {r.get('row', '?'):<16}{_f(r.get('batch')):>5}{_f(r.get('tokens_per_s')):>9}"
            f"{_f(r.get('ms_per_round'), 2):>9}{_f(r.get('mean_accepted_len'), 2):>8}"
            f"{_f(r.get('roofline_share'), 3):>9}{_f(r.get('host_syncs_per_round')):>6}"
            f"{_f(r.get('cache_hit_rate'), 2):>6}  {_launches(r)}"
            + (f"  [{r['status']}]" if r.get("status", "ok") != "ok" else "")
            + (f"  (ran {r['ran']})" if r.get("ran") and r.get("ran") != r.get("mode") else "")
        )
    return lines


def table(report: dict) -> str:
    """The tables printed at the end: per part its status, then its rows."""
    parts, lines = report.get("parts", {}), []
    for name in PARTS:
        part = parts.get(name)
        if part is None:
            continue
        lines.append(
            f"part {name} ({part.get('title', '')}): {part.get('status')}"
            + (f" in {part['seconds']:.0f}s" if isinstance(part.get("seconds"), (int, float)) else "")
        )
        env = part.get("environment")
        if env:
            gpu = env.get("gpu") or {}
            lines.append(
                f"  torch {env.get('torch')}, triton {env.get('triton')}, transformers {env.get('transformers')}"
                f", {gpu.get('name', 'no GPU')}, commit {env.get('commit')}"
            )
        bw = part.get("bandwidth") or {}
        if bw.get("gb_per_s"):
            lines.append(f"  copy bandwidth {bw['gb_per_s']:.1f} GB/s ({bw.get('how')})")
        models = part.get("models") or {}
        if models.get("bytes_per_token"):
            b = models["bytes_per_token"]
            lines.append(
                f"  bytes per token: target {b['target'] / 1e9:.3f} GB, draft {b['draft'] / 1e9:.3f} GB "
                f"(c by bytes {_f(models.get('c_bytes'), 3)}); greedy agreement "
                f"{_f((models.get('tuning') or {}).get('agreement'), 2)}"
            )
        if part.get("rows"):
            lines += rows_table(part["rows"])
        micro = (part.get("micro") or {}).get("rows", [])
        cuda_only = [r for r in micro if str(r.get("status", "")).startswith("skipped: CUDA only")]
        for row in (r for r in micro if r not in cuda_only):
            lines.append(
                f"  micro {row.get('what')}: {row.get('variant')} {_f(row.get('us'), 1)} us"
                + (f" [{row['status']}]" if row.get("status", "ok") != "ok" else "")
            )
        if cuda_only:
            lines.append(f"  micro: {len(cuda_only)} compiled variants run on CUDA only")
        over = part.get("overlap") or {}
        if over.get("rounds"):
            lines.append(
                f"  overlap: build hidden under verify {_f(over.get('hidden_fraction_gpu'), 2)} (GPU), "
                f"{_f(over.get('hidden_fraction_host'), 2)} (host clock); {over['rounds']} rounds"
            )
        for sub, data in (part.get("subphases") or {}).items():
            checks = data.get("checks", [])
            good = sum(1 for c in checks if c.get("ok"))
            bad = [c["name"] for c in checks if c.get("ok") is False]
            lines.append(
                f"  exactness {sub}: {data.get('status')}: {good}/{len(checks)} true"
                + (f"; FALSE: {', '.join(bad)}" if bad else "")
            )
        trace = part.get("trace") or {}
        if trace.get("file"):
            lines.append(f"  trace: {trace['file']} ({trace.get('rounds')} rounds)")
    summary = report.get("summary", {})
    verdict = summary.get("exactness_all_true")
    lines.append(
        f"exactness all true: {'not run' if verdict is None else verdict} "
        f"({summary.get('exactness_checks', 0)} checks)"
    )
    return "\n".join(lines)
