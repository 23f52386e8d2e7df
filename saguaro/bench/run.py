"""Benchmark: Saguaro's modes (AR, SD, SSD) against ``transformers``, in one run.

:func:`run_bench` takes explicit :class:`BenchParams` (the CLI builds them from its arguments),
compiles and warms up every stage, runs the rows of :mod:`saguaro.bench.rows` over the same prompts
and returns the report: rows (tokens/s, mean accepted length, speed-up over AR, SSD columns),
compile times and the machine. Speed is only ever compared as ratios within one run on one machine.
"""

from __future__ import annotations

import json
import logging
import platform
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from saguaro.bench.rows import ALL_MODES, DRAFT_MODES, HF_MODES, SAGUARO_MODES
from saguaro.bench.worker import BenchParams, params_json, run_one, run_prompts

log = logging.getLogger(__name__)


def bench_modes(params: BenchParams) -> tuple[list[str], dict]:
    """The rows to run and ``{row: reason}`` of the rows left out."""
    modes = list(params.modes) if params.modes is not None else list(ALL_MODES)
    skipped = {}
    if params.batch > 1 and "hf-assisted" in modes:
        reason = "transformers' assisted generation runs one sequence at a time (--batch 1)"
        if params.modes is not None:
            raise ValueError(f"--modes hf-assisted is not allowed with --batch {params.batch}: {reason}")
        modes.remove("hf-assisted")
        skipped["hf-assisted"] = reason
    return modes, skipped


def run_row(params: BenchParams, mode: str, backend: str) -> dict:
    """One row, in a process of its own unless ``params.same_process``."""
    if params.same_process:
        return run_one(params, mode, backend)
    with tempfile.TemporaryDirectory(prefix="saguaro_bench_") as folder:
        out = Path(folder) / "row.json"
        cmd = [sys.executable, "-m", "saguaro.bench.worker", params_json(params), mode, backend, str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not out.exists():
            tail = "\n".join(done.stderr.strip().splitlines()[-15:])
            raise RuntimeError(f"benchmark row {mode} ({backend}) failed with exit code {done.returncode}:\n{tail}")
        return json.loads(out.read_text())


def run_bench(params: BenchParams, announce=lambda line: None) -> dict:
    """Run the benchmark; ``announce(line)`` receives a line saying which prompts, then a progress line
    per row. Returns the report: ``config``, ``machine``, ``prompts`` (their source: ``heldout``,
    ``fixed`` or ``random``, and why), ``rows``, ``compile_s`` and ``skipped``."""
    from saguaro.models_io import load_pair

    modes, skipped = bench_modes(params)
    # bad folders fail here, at once, not in a row's process
    target, _, tokenizer = load_pair(params.target, params.draft, need_draft=any(m in DRAFT_MODES for m in modes),
                                     device="cpu")
    prompts = run_prompts(params, tokenizer, target)
    announce(f"prompts ({prompts.source}): {len(prompts.ids)} {prompts.detail}")
    backends = ["eager", "inductor"] if params.backend == "both" else [params.backend]
    rows, compile_s = [], {}
    for backend in backends:
        for mode in modes:
            if mode in HF_MODES and backend != backends[0]:
                continue
            announce(f"{mode} ({backend if mode in SAGUARO_MODES else 'transformers'}): warm-up, then timed")
            row = run_row(params, mode, backend)
            if mode in SAGUARO_MODES:
                compile_s[f"{mode}[{backend}]"] = row["setup_s"]
                announce(f"  {row['tokens_per_s']:.1f} tokens/s; capture + compile + warm-up took {row['setup_s']:.1f}s")
                if len(backends) > 1:
                    row["mode"] = f"{mode}[{backend}]"
            rows.append(row)
    base = next((r["tokens_per_s"] for r in rows if r["mode"] in ("ar", "ar[eager]")), None)
    for row in rows:
        row["speedup_vs_ar"] = row["tokens_per_s"] / base if base else None
    sd = next((r["tokens_per_s"] for r in rows if r["mode"] in ("sd", f"sd[{backends[-1]}]")), None)
    for row in rows:
        row["speedup_vs_sd"] = row["tokens_per_s"] / sd if sd else None
    differ = [r["mode"] for r in rows if r.get("prompt_source") != prompts.source]
    if differ:
        log.warning("rows %s did not run on the %s prompts the report names", differ, prompts.source)
    config = asdict(params) | {"target": params.target or "default", "draft": params.draft or "default"}
    return {
        "config": config,
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads()},
        "prompts": prompts.describe(),
        "rows": rows,
        "compile_s": compile_s,
        "skipped": skipped,
    }
