"""The GPU probe's report (``gpu_probe.json``): how it is written, its summary, the table printed last."""

from __future__ import annotations

import json
from pathlib import Path

PHASES = ("environment", "exactness", "speed", "overlap")


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
        exactness = report.get("phases", {}).get("exactness")
        if exactness is not None and exactness.get("subphases"):
            exactness["status"] = exactness_status(exactness["subphases"])
        report["summary"] = summarize(report)
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=2, default=str))
        tmp.replace(self.path)


def phase_keys(name: str) -> tuple:
    """Where a phase (``speed``) or exactness sub-phase (``exactness:eager``) lives in the report."""
    phase, _, sub = name.partition(":")
    return ("phases", phase, "subphases", sub) if sub else ("phases", phase)


def exactness_status(subphases: dict) -> str:
    """The exactness phase's status, from its sub-phases'."""
    statuses = {sub: str(data.get("status", "pending")) for sub, data in subphases.items()}
    if any(s in ("pending", "running") for s in statuses.values()):
        return "running"
    if all(s == "ok" or s.startswith("skipped: not in") for s in statuses.values()):
        return "ok"
    return "; ".join(f"{sub}: {s}" for sub, s in statuses.items() if s != "ok" and not s.startswith("skipped: not in"))


def summarize(report: dict) -> dict:
    """Exactness over every check that ran, and each phase's status."""
    phases = report.get("phases", {})
    exactness = phases.get("exactness", {})
    checks, errors = [], []
    for sub, data in exactness.get("subphases", {}).items():
        checks += [dict(c, subphase=sub) for c in data.get("checks", [])]
        if str(data.get("status", "")).startswith("error"):
            errors.append(sub)
    failed = [f"{c['subphase']}/{c['name']}" for c in checks if c.get("ok") is False]
    subphases = exactness.get("subphases", {}).values()
    ran = any(not str(d.get("status", "")).startswith("skipped: not in") for d in subphases)
    return {  # None: exactness was not asked for
        "exactness_all_true": (bool(checks) and not failed and not errors) if ran else None,
        "exactness_checks": len(checks), "exactness_failed": failed, "exactness_subphase_errors": errors,
        "status": {p: phases.get(p, {}).get("status", "not run") for p in PHASES},
    }


def _f(value, digits=1) -> str:
    return "-" if value is None else (f"{value:.{digits}f}" if isinstance(value, float) else str(value))


def table(report: dict) -> str:
    """The short table printed at the end: each phase's status and its main figures."""
    phases, lines = report.get("phases", {}), []
    env = phases.get("environment", {})
    gpu = env.get("gpu", {})
    lines.append(f"environment  {env.get('status')}: torch {env.get('torch')}, transformers "
                 f"{env.get('transformers')}, triton {env.get('triton')}, {gpu.get('name', 'no GPU')}"
                 f"{' (sm ' + gpu['compute_capability'] + ')' if gpu else ''}")
    exact = phases.get("exactness", {})
    lines.append(f"exactness    {exact.get('status')}")
    for sub, data in exact.get("subphases", {}).items():
        checks = data.get("checks", [])
        if str(data.get("status")).startswith("skipped"):
            lines.append(f"  {sub:<27} {str(data.get('status')).split(' (')[0]}")
            continue
        good = sum(1 for c in checks if c.get("ok"))
        bad = [c["name"] for c in checks if c.get("ok") is False]
        astray = sum(1 for c in checks if c.get("ran_as_asked") is False)
        lines.append(f"  {sub:<27} {str(data.get('status')).split(';')[0]}: {good}/{len(checks)} checks true"
                     + (f"; FALSE: {', '.join(bad)}" if bad else "")
                     + (f" ({astray} did not run the path they name: see ran, lane, lane_failures)" if astray else ""))
    speed_phase = phases.get("speed", {})
    lines.append(f"speed        {speed_phase.get('status')}"
                 + (f": greedy agreement {_f(speed_phase.get('tuning', {}).get('agreement'), 2)}"
                    if speed_phase.get("tuning") else ""))
    rows = speed_phase.get("rows", [])
    if rows:
        lines.append(f"  {'batch':>5} {'row':<12} {'tok/s':>9} {'ms/round':>9} {'acc.len':>8} {'hit':>6} "
                     f"{'planned SD':>10}")
        for r in rows:
            lines.append(f"  {r.get('batch'):>5} {r.get('row'):<12} {_f(r.get('tokens_per_s')):>9} "
                         f"{_f(r.get('ms_per_round'), 2):>9} {_f(r.get('mean_accepted_len'), 2):>8} "
                         f"{_f(r.get('cache_hit_rate'), 2):>6} {_f(r.get('planned_sd')):>10}"
                         + (f"  {r['status']}" if r.get("status", "ok") != "ok" else "")
                         + (f"  (ran {r['ran']}, lane failures {r.get('lane_failures')})"
                            if r.get("ran") and r["ran"] != r["row"].removesuffix("_planner") else ""))
    over = phases.get("overlap", {})
    lines.append(f"overlap      {over.get('status')}")
    for batch, data in over.get("batches", {}).items():
        lines.append(f"  batch {batch}: build hidden under verify {_f(data.get('hidden_fraction_gpu'), 2)} (GPU), "
                     f"{_f(data.get('hidden_fraction_host'), 2)} (host clock); {data.get('rounds', 0)} rounds"
                     + ("" if data.get("rounds") else f" (ran {data.get('ran')}, lane failures "
                                                      f"{data.get('lane_failures')}: {data.get('plan')})"))
    if over.get("trace"):
        lines.append(f"  trace: {over['trace']}")
    summary = report.get("summary", {})
    verdict = summary.get("exactness_all_true")
    lines.append(f"exactness all true: {'not run' if verdict is None else verdict} "
                 f"({summary.get('exactness_checks', 0)} checks)")
    return "\n".join(lines)
