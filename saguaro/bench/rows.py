"""The benchmark's rows: each mode of :data:`ALL_MODES` timed over the same prompts after a warm-up call,
its timed passes alternating with the other rows' (:mod:`saguaro.bench.passes`); each row: docs/bench.md.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from saguaro.bench.passes import TimedPass, add_speedups, combine, interleaved

# re-exported: the CLI, the demo and benchmarks/ use it
from saguaro.bench.prompts import bench_prompts  # noqa: F401

log = logging.getLogger(__name__)

SAGUARO_MODES = ("ar", "sd", "ssd", "ssd-uniform", "ssd-process")
HF_MODES = ("hf-assisted", "hf")
ALL_MODES = SAGUARO_MODES + HF_MODES
DRAFT_MODES = ("sd", "ssd", "ssd-uniform", "ssd-process", "hf-assisted")  # rows that run the draft


def _batches(prompts, batch, pad_id):
    for start in range(0, len(prompts), batch):
        group = prompts[start : start + batch]
        width = max(p.shape[1] for p in group)
        ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(group):
            ids[row, width - p.shape[1] :] = p[0]
            mask[row, width - p.shape[1] :] = 1
        yield ids, mask


def compile_for(
    target,
    draft,
    k: int,
    backend: str = "inductor",
    sd_when_faster: bool = True,
    compile: str = "blocking",
    linears: str = "auto",
    narrow_weights: bool = True,
    **weights,
):
    """One Program serving every Saguaro row (mode ``ssd`` with a draft, ``ar`` without one); the options
    are ``SaguaroConfig``'s (``weights``: its ``weights``, ``draft_weights``, ``weight_group_size``)."""
    from saguaro.compile import compile as saguaro_compile

    start = time.perf_counter()
    program = saguaro_compile(
        target,
        draft,
        k=k,
        mode="ssd" if draft is not None else "ar",
        backend=backend,
        sd_when_faster=sd_when_faster,
        compile=compile,
        linears=linears,
        narrow_weights=narrow_weights,
        **weights,
    )
    log.info("compiled in %.1fs", time.perf_counter() - start)
    return program


def row_program(program, mode: str):
    """The program and the ``generate`` mode of a Saguaro row."""
    if mode == "ssd-uniform":
        per_position = max(1, program.config.budget // (program.config.k + 1))
        return program.variant(fan_out=per_position), "ssd"
    if mode == "ssd":
        return program.variant(lane="thread"), "ssd"
    if mode == "ssd-process":
        return program.variant(lane="process"), "ssd"
    return program, mode


def run_rows(
    target,
    draft,
    prompts,
    modes,
    k,
    max_new_tokens,
    temperature,
    batch,
    seed,
    backend="eager",
    program=None,
    trace_dir=None,
    repeats=3,
):
    """Every requested row over the same prompts in this process, ``repeats`` interleaved timed passes each
    after a warm-up: the rows. ``program``: a compiled Program to reuse (its ``k`` and backend win);
    ``trace_dir``: each Saguaro row's timeline written there (:meth:`RowTimer.write_trace`)."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} is not allowed: it must be an int >= 1")
    if program is None and any(m in SAGUARO_MODES for m in modes):
        program = compile_for(target, draft, k, backend)
    timers = [
        RowTimer(target, draft, program, prompts, mode, k, max_new_tokens, temperature, batch, seed)
        for mode in modes
    ]
    for timer in timers:
        timer.warm_up()
    for timer in interleaved(timers, repeats):
        timer.timed_pass()
    rows = []
    for timer in timers:
        if trace_dir is not None:
            timer.write_trace(trace_dir, backend)
        rows.append(timer.row())
    add_speedups(rows, ar=("ar",), sd=("sd",))
    return rows


def time_row(
    target,
    draft,
    program,
    prompts,
    mode,
    k,
    max_new_tokens,
    temperature,
    batch,
    seed,
    trace_dir=None,
    backend="inductor",
    repeats=1,
) -> dict:
    """One row alone: warmed up, then ``repeats`` timed passes, then with ``trace_dir`` its timeline
    (see :func:`run_rows`)."""
    timer = RowTimer(target, draft, program, prompts, mode, k, max_new_tokens, temperature, batch, seed)
    timer.warm_up()
    for _ in range(repeats):
        timer.timed_pass()
    if trace_dir is not None:
        timer.write_trace(trace_dir, backend)
    return timer.row()


class RowTimer:
    """One row over prompts (each ``[1, T]``) in batches of ``batch``: :meth:`warm_up` once (every shape
    compiled and warm), :meth:`timed_pass` as often as the caller interleaves it, then :meth:`row`."""

    def __init__(self, target, draft, program, prompts, mode, k, max_new_tokens, temperature, batch, seed):
        if mode in DRAFT_MODES and mode in SAGUARO_MODES and (program is None or program.draft is None):
            raise ValueError(f"row {mode!r} needs a draft model")
        self.target = target
        self.draft = draft
        self.program = program
        self.mode = mode
        self.k = k
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.seed = seed
        self.pad_id = program.pad_token_id if program is not None else _pad_id(target)
        self.batches = list(_batches(prompts, batch, self.pad_id))  # [(ids [b, T], mask [b, T])]
        self.passes: list[TimedPass] = []

    def _call(self, ids, mask):
        return _generate(
            self.target,
            self.draft,
            self.program,
            self.mode,
            ids,
            mask,
            self.k,
            self.max_new_tokens,
            self.temperature,
            self.seed,
            self.pad_id,
        )

    def warm_up(self) -> None:
        log.info("running %s: warm-up", self.mode)
        for ids, mask in self.batches:
            self._call(ids, mask)
        if self.program is not None:
            self.program.wait_compiled()  # background compiles queued by the warm-up: time them compiled

    def timed_pass(self) -> TimedPass:
        log.info("running %s: timed pass %d", self.mode, len(self.passes) + 1)
        timed = TimedPass()
        for ids, mask in self.batches:
            start = time.perf_counter()
            produced, out = self._call(ids, mask)
            timed.add(produced, time.perf_counter() - start, out)
        timed.ended = time.time()
        self.passes.append(timed)
        return timed

    def write_trace(self, trace_dir, backend: str) -> None:
        """A Saguaro row: one more untimed call on the first batch, its trace in ``trace_dir``."""
        if self.mode not in SAGUARO_MODES:
            return
        row_prog, row_mode = row_program(self.program, self.mode)
        path = Path(trace_dir) / f"{self.mode}-{backend}.json"
        ids, mask = self.batches[0]
        row_prog.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            seed=self.seed,
            mode=row_mode,
            eos_token_id=None,
            trace=path,
        )
        log.info("wrote the trace of %s to %s", self.mode, path)

    def row(self) -> dict:
        return combine(self.mode, self.passes)


def _generate(target, draft, program, mode, ids, mask, k, max_new_tokens, temperature, seed, pad_id):
    """``(tokens produced, GenerateOutput or None)`` of one call of a row."""
    if mode in SAGUARO_MODES:
        row_prog, row_mode = row_program(program, mode)
        out = row_prog.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            seed=seed,
            mode=row_mode,
            eos_token_id=None,
        )
        _synchronize(target)
        return int(out.stats["new_tokens"]), out
    produced = _hf_generate(
        target,
        draft if mode == "hf-assisted" else None,
        ids,
        mask,
        max_new_tokens,
        temperature,
        k,
        pad_id,
        seed,
    )
    _synchronize(target)
    return produced, None


def _synchronize(model) -> None:
    """Wait for queued GPU work, so a row's wall time covers all of it (``model`` None: a loaded
    program's rows, synchronised on the CPU already)."""
    if model is None:
        return
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pad_id(model) -> int:
    gen = getattr(model, "generation_config", None)
    for value in (getattr(gen, "pad_token_id", None), getattr(gen, "eos_token_id", None)):
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


@torch.inference_mode()
def _hf_generate(target, assistant, ids, mask, max_new_tokens, temperature, k, pad_id, seed) -> int:
    device = next(target.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        pad_token_id=pad_id,
        eos_token_id=None,
    )
    if temperature > 0:
        torch.manual_seed(seed)
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kwargs.update(do_sample=False)
    if assistant is not None:
        kwargs.update(
            assistant_model=assistant, num_assistant_tokens=k, num_assistant_tokens_schedule="constant"
        )
    out = target.generate(ids, **kwargs)
    return int((out.shape[1] - ids.shape[1]) * ids.shape[0])
