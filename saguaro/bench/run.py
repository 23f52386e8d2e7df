"""Benchmark: Saguaro's modes (AR, SD, SSD) against ``transformers``, in one run.

:func:`run_bench` takes :class:`BenchParams`, warms every row up, runs their timed passes interleaved over
the same prompts (:mod:`saguaro.bench.passes`) and returns the report. Speed is only ever compared as ratios
within one run on one machine.
"""

from __future__ import annotations

import json
import logging
import platform
import subprocess
import sys
import tempfile
from dataclasses import asdict

import torch

from saguaro.bench.bandwidth import add_bandwidth, measure_read_gbs
from saguaro.bench.passes import add_speedups, interleaved
from saguaro.bench.report import busy_rows
from saguaro.bench.rows import ALL_MODES, DRAFT_MODES, HF_MODES, SAGUARO_MODES
from saguaro.bench.worker import BenchParams, RowSession, params_json, run_prompts

log = logging.getLogger(__name__)

WORKER = ("-m", "saguaro.bench.worker")  # a row's process: python WORKER PARAMS_JSON MODE BACKEND
EXIT_TIMEOUT_S = 30  # how long a row's process may take to exit once its stdin is closed


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


class WorkerRow:
    """One row in a process of its own (:mod:`saguaro.bench.worker`): started, loaded, compiled and warmed
    up when built; then it runs a timed pass each time :meth:`time_pass` asks, and returns its row from
    :meth:`finish`. Its stderr goes to a temporary file, so a chatty row never blocks on a full pipe."""

    def __init__(self, params: BenchParams, mode: str, backend: str):
        self.name = f"{mode} ({backend})"
        self._stderr = tempfile.TemporaryFile(mode="w+", errors="replace", prefix="saguaro_bench_")
        cmd = [sys.executable, *WORKER, params_json(params), mode, backend]
        self._process = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True, bufsize=1
        )
        try:
            # the worker's own clock: capture, compile, warm-up
            self.setup_s = self._answer("ready", "setup_s")
        except BaseException:
            self.close()
            raise

    def time_pass(self) -> dict:
        return self._ask("time", "timed")

    def finish(self) -> dict:
        """The row; the process then exits (:meth:`close` waits for it, so the rows' exits overlap)."""
        return self._ask("finish", "row")

    def close(self) -> None:
        """End the process: its stdin closed, it exits, or is killed after :data:`EXIT_TIMEOUT_S`."""
        if self._process.stdin and not self._process.stdin.closed:
            try:
                self._process.stdin.close()
            except OSError:
                pass  # it is gone already
        try:
            self._process.wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._process.stdout.close()
        self._stderr.close()

    def _ask(self, request: str, answer: str):
        try:
            self._process.stdin.write(json.dumps({"do": request}) + "\n")
            self._process.stdin.flush()
        except OSError:
            raise self._failed() from None
        return self._answer(answer)

    def _answer(self, key: str, field: str | None = None):
        """The next answer, which must hold ``key``: its ``key`` value, or its ``field`` value when given."""
        line = self._process.stdout.readline()
        if not line:
            raise self._failed()
        answer = json.loads(line)
        if key not in answer:
            raise RuntimeError(f"benchmark row {self.name}: expected a {key!r} answer, got {sorted(answer)}")
        return answer[key if field is None else field]

    def _failed(self) -> RuntimeError:
        code = self._process.wait()
        self._stderr.seek(0)
        tail = "\n".join(self._stderr.read().strip().splitlines()[-15:])
        return RuntimeError(f"benchmark row {self.name} failed with exit code {code}:\n{tail}")


def start_row(params: BenchParams, mode: str, backend: str):
    """One row, loaded and warm, in a process of its own unless ``params.same_process``; it has
    ``setup_s``, ``time_pass()``, ``finish()`` and ``close()``."""
    if params.same_process:
        return RowSession(params, mode, backend)
    return WorkerRow(params, mode, backend)


def run_bench(params: BenchParams, announce=lambda line: None) -> dict:
    """Run the benchmark: every row started and warmed up in turn (each in its own process by default),
    then their timed passes alternating, one row computing at a time. ``announce(line)`` hears progress.

    Returns the report: ``config`` (``order``: the passes as they ran), ``machine``, ``prompts``, ``rows``,
    ``compile_s``, ``skipped`` and ``busy_machine`` (:func:`~saguaro.bench.report.busy_rows`)."""
    from saguaro.models_io import load_pair

    modes, skipped = bench_modes(params)
    # bad folders fail here, at once, not in a row's process
    target, _, tokenizer = load_pair(
        params.target, params.draft, need_draft=any(m in DRAFT_MODES for m in modes), device="cpu"
    )
    prompts = run_prompts(params, tokenizer, target)
    announce(f"prompts ({prompts.source}): {len(prompts.ids)} {prompts.detail}")
    backends = ["eager", "inductor"] if params.backend == "both" else [params.backend]
    specs = [
        (mode, backend)
        for backend in backends
        for mode in modes
        if mode not in HF_MODES or backend == backends[0]
    ]
    labels = [
        f"{mode}[{backend}]" if mode in SAGUARO_MODES and len(backends) > 1 else mode
        for mode, backend in specs
    ]
    order = interleaved(labels, params.repeats)
    read_gbs = measure_read_gbs(params.threads) if torch.device(params.device).type == "cpu" else None
    if read_gbs is not None:
        announce(
            f"memory read bandwidth, measured now: {read_gbs:.1f} GB/s on "
            f"{params.threads or torch.get_num_threads()} threads (the roofline of the GB/s column)"
        )
    started, compile_s = {}, {}
    try:
        for label, (mode, backend) in zip(labels, specs):
            announce(
                f"{mode} ({backend if mode in SAGUARO_MODES else 'transformers'}): load, compile, warm up"
            )
            started[label] = start_row(params, mode, backend)
            if mode in SAGUARO_MODES:
                compile_s[f"{mode}[{backend}]"] = started[label].setup_s
                announce(f"  ready; capture + compile + warm-up took {started[label].setup_s:.1f}s")
        for round_start in range(0, len(order), len(labels)):
            speeds = [
                f"{label} {started[label].time_pass()['tokens_per_s']:.1f}"
                for label in order[round_start : round_start + len(labels)]
            ]
            announce(
                f"timed pass {round_start // len(labels) + 1}/{params.repeats}, tokens/s: {', '.join(speeds)}"
            )
        rows = [started[label].finish() | {"mode": label} for label in labels]
    finally:
        for row in started.values():
            row.close()  # waits for each process to exit; ends those of a failed run
    add_speedups(rows, ar=("ar", "ar[eager]"), sd=("sd", f"sd[{backends[-1]}]"))
    for row in rows:
        add_bandwidth(row, read_gbs)
    differ = [r["mode"] for r in rows if r.get("prompt_source") != prompts.source]
    if differ:
        log.warning("rows %s did not run on the %s prompts the report names", differ, prompts.source)
    config = asdict(params) | {
        "target": params.target or "default",
        "draft": params.draft or "default",
        "order": order,
    }
    return {
        "config": config,
        "machine": {
            "platform": platform.platform(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "read_gbs": read_gbs,
        },
        "prompts": prompts.describe(),
        "rows": rows,
        "compile_s": compile_s,
        "skipped": skipped,
        "busy_machine": busy_rows(rows),
    }
