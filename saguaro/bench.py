"""Benchmark: Saguaro's modes (AR, SD, SSD) against ``transformers``, in one run.

:func:`run_bench` takes explicit :class:`BenchParams` (the CLI builds them from its arguments),
compiles and warms up every stage, runs the rows of :mod:`saguaro.bench_rows` over the same prompts
and returns the report: rows (tokens/s, mean accepted length, speed-up over AR, SSD columns),
compile times and the machine. Speed is only ever compared as ratios within one run on one machine.
"""

from __future__ import annotations

import logging
import platform
import time
from dataclasses import asdict, dataclass

import torch

from saguaro.bench_rows import (
    ALL_MODES, DRAFT_MODES, HF_MODES, SAGUARO_MODES, _batches, bench_prompts, compile_for, row_program, run_rows,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchParams:
    """What one benchmark run measures. ``modes=None``: every row that applies."""

    target: str | None = None  # a save_pretrained folder; None with draft None: the default pair
    draft: str | None = None
    modes: tuple | None = None
    prompts: int = 8
    batch: int = 1
    k: int = 5
    max_new_tokens: int = 64
    temperature: float = 0.0
    backend: str = "eager"  # "eager", "inductor" or "both"
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    threads: int | None = None
    trace_dir: str | None = None  # write one timeline per Saguaro row here


def compile_and_warm(target, draft, prompts, modes, params: BenchParams, backend):
    """Compile for ``backend`` and run every mode on two prompt lengths, so that capture, stage building
    and (inductor) compilation, static and dynamic, all happen before any timed row. Returns
    ``(program, seconds)``."""
    started = time.perf_counter()
    program = compile_for(target, draft if any(m in DRAFT_MODES for m in modes) else None, params.k, backend)
    warm = list(_batches(prompts[:2], 1, program.pad_token_id))
    warm += list(_batches(prompts[:params.batch], params.batch, program.pad_token_id))
    for mode in modes:
        row_prog, row_mode = row_program(program, mode)
        for ids, mask in warm:
            row_prog.generate(ids, attention_mask=mask, max_new_tokens=params.max_new_tokens,
                              temperature=params.temperature, seed=params.seed, mode=row_mode, eos_token_id=None)
    return program, time.perf_counter() - started


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


def run_bench(params: BenchParams, announce=lambda line: None) -> dict:
    """Run the benchmark; ``announce(line)`` receives progress lines (compile times). Returns the report:
    ``config``, ``machine``, ``rows``, ``compile_s`` and ``skipped``."""
    from saguaro.models_io import DTYPES, load_pair

    modes, skipped = bench_modes(params)
    if params.threads is not None:
        torch.set_num_threads(params.threads)
    need_draft = any(m in DRAFT_MODES for m in modes)
    target, draft, tokenizer = load_pair(params.target, params.draft, need_draft=need_draft,
                                         dtype=DTYPES[params.dtype], device=params.device)
    if not need_draft:
        draft = None
    prompts = bench_prompts(tokenizer, params.prompts, target.config.vocab_size, params.seed)
    backends = ["eager", "inductor"] if params.backend == "both" else [params.backend]
    rows, compile_s = [], {}
    for backend in backends:
        saguaro_modes = [m for m in modes if m in SAGUARO_MODES]
        hf_modes = [m for m in modes if m in HF_MODES] if backend == backends[0] else []
        program = None
        if saguaro_modes:
            program, compile_s[backend] = compile_and_warm(target, draft, prompts, saguaro_modes, params, backend)
            announce(f"{backend}: capture + compile + warm-up of every stage took {compile_s[backend]:.1f}s")
        part = run_rows(target, draft, prompts, saguaro_modes + hf_modes, params.k, params.max_new_tokens,
                        params.temperature, params.batch, params.seed, backend=backend, program=program,
                        trace_dir=params.trace_dir)
        for row in part:
            if row["mode"] in SAGUARO_MODES:
                row["backend"] = backend
                if len(backends) > 1:
                    row["mode"] = f"{row['mode']}[{backend}]"
        rows.extend(part)
        if program is not None:
            program.close()
    base = next((r["tokens_per_s"] for r in rows if r["mode"] in ("ar", "ar[eager]")), None)
    for row in rows:
        row["speedup_vs_ar"] = row["tokens_per_s"] / base if base else None
    config = asdict(params) | {"target": params.target or "default", "draft": params.draft or "default"}
    return {
        "config": config,
        "machine": {"platform": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads()},
        "rows": rows,
        "compile_s": compile_s,
        "skipped": skipped,
    }
