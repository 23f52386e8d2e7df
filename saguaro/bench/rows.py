"""The benchmark's rows: each mode timed over the same prompts, after a warm-up call.

Rows: ``ar`` (Saguaro, target alone), ``sd`` (Saguaro speculative decoding), ``ssd`` (the
planner's trees, draft on a worker thread), ``ssd-uniform`` (the whole budget every round, spread
evenly over the ``k+1`` positions), ``ssd-process`` (the planner's trees, draft in another process),
``hf-assisted``
(``transformers`` assisted generation with the same draft and ``k``) and ``hf`` (``transformers``
greedy/sampled generate, target alone).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from saguaro.bench.prompts import bench_prompts  # noqa: F401 - re-exported: the CLI, the demo and benchmarks/ use it
from saguaro.runtime.base.stats import percentile

log = logging.getLogger(__name__)

SAGUARO_MODES = ("ar", "sd", "ssd", "ssd-uniform", "ssd-process")
HF_MODES = ("hf-assisted", "hf")
ALL_MODES = SAGUARO_MODES + HF_MODES
DRAFT_MODES = ("sd", "ssd", "ssd-uniform", "ssd-process", "hf-assisted")  # rows that run the draft


def _batches(prompts, batch, pad_id):
    for start in range(0, len(prompts), batch):
        group = prompts[start:start + batch]
        width = max(p.shape[1] for p in group)
        ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(group):
            ids[row, width - p.shape[1]:] = p[0]
            mask[row, width - p.shape[1]:] = 1
        yield ids, mask


def compile_for(target, draft, k: int, backend: str = "inductor", sd_when_faster: bool = True,
                compile: str = "blocking"):
    """One Program serving every Saguaro row (``ssd`` with a draft, ``ar`` without one); ``sd_when_faster``
    False (``--plan always-ssd``): SSD rows run SSD's own rounds on any machine. A row times blocking
    programs (``compile="background"`` is for a first, untimed generation)."""
    from saguaro.compile import compile as saguaro_compile

    start = time.perf_counter()
    program = saguaro_compile(target, draft, k=k, mode="ssd" if draft is not None else "ar", backend=backend,
                              sd_when_faster=sd_when_faster, compile=compile)
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


def run_rows(target, draft, prompts, modes, k, max_new_tokens, temperature, batch, seed, backend="eager",
             program=None, trace_dir=None):  # noqa: PLR0913 - the benchmark's explicit parameters
    """Run every requested row over the same prompts in this process; return a list of result dicts.

    ``program`` reuses an already compiled Program (its ``k`` and backend win). ``trace_dir``: after a
    Saguaro row's timed calls, one more (untimed) call on the first batch writes its timeline to
    ``trace_dir/<row>-<backend>.json``.
    """
    if program is None and any(m in SAGUARO_MODES for m in modes):
        program = compile_for(target, draft, k, backend)
    rows = [time_row(target, draft, program, prompts, mode, k, max_new_tokens, temperature, batch, seed,
                     trace_dir=trace_dir, backend=backend) for mode in modes]
    ar = next((r["tokens_per_s"] for r in rows if r["mode"] == "ar"), None)
    sd = next((r["tokens_per_s"] for r in rows if r["mode"] == "sd"), None)
    for row in rows:
        row["speedup_vs_ar"] = row["tokens_per_s"] / ar if ar else None
        row["speedup_vs_sd"] = row["tokens_per_s"] / sd if sd else None
    return rows


def time_row(target, draft, program, prompts, mode, k, max_new_tokens, temperature, batch, seed,
             trace_dir=None, backend="inductor") -> dict:  # noqa: PLR0913
    """One row: every batch of prompts generated once untimed (each shape bucket compiled and warm),
    then once timed; with ``trace_dir``, a Saguaro row then runs the first batch once more, untimed,
    writing its timeline to ``trace_dir/<row>-<backend>.json``."""
    if mode in DRAFT_MODES and mode in SAGUARO_MODES and (program is None or program.draft is None):
        raise ValueError(f"row {mode!r} needs a draft model")
    pad_id = program.pad_token_id if program is not None else _pad_id(target)
    batches = list(_batches(prompts, batch, pad_id))
    log.info("running %s: warm-up", mode)
    for ids, mask in batches:
        _generate(target, draft, program, mode, ids, mask, k, max_new_tokens, temperature, seed, pad_id)
    if program is not None:
        program.wait_compiled()  # compile="background": the warm-up queued its shapes; time them compiled
    log.info("running %s: timed", mode)
    new_tokens, wall, accepted, rounds, ssd, round_s, token_s = 0, 0.0, 0.0, 0, [], [], []
    for ids, mask in batches:
        start = time.perf_counter()
        produced, out = _generate(target, draft, program, mode, ids, mask, k, max_new_tokens, temperature, seed,
                                  pad_id)
        wall += time.perf_counter() - start
        new_tokens += produced
        stats = out.stats if out is not None else {}
        if stats.get("rounds"):
            # weight each call's mean by its rounds, so the row's mean is per round
            accepted += stats["mean_accepted_len"] * stats["rounds"]
            rounds += stats["rounds"]
            round_s += out.counters.round_s
            token_s += out.counters.token_s
        if stats.get("cache_hit_rate") is not None:
            ssd.append(stats)
    if trace_dir is not None and mode in SAGUARO_MODES:
        row_prog, row_mode = row_program(program, mode)
        path = Path(trace_dir) / f"{mode}-{backend}.json"
        ids, mask = batches[0]
        row_prog.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                          mode=row_mode, eos_token_id=None, trace=path)
        log.info("wrote the trace of %s to %s", mode, path)
    row = {
        "mode": mode, "tokens_per_s": new_tokens / wall if wall else 0.0, "new_tokens": new_tokens,
        "wall_s": wall, "mean_accepted_len": accepted / rounds if rounds else None,
        "rounds": rounds if rounds else None,
        "round_ms_p50": 1000 * percentile(round_s, 50) if round_s else None,
        "round_ms_p99": 1000 * percentile(round_s, 99) if round_s else None,
        "token_ms_p50": 1000 * percentile(token_s, 50) if token_s else None,
        "token_ms_p99": 1000 * percentile(token_s, 99) if token_s else None,
    }
    if ssd:
        row.update(_ssd_summary(ssd, rounds))
    return row


def _generate(target, draft, program, mode, ids, mask, k, max_new_tokens, temperature, seed, pad_id):
    """``(tokens produced, GenerateOutput or None)`` of one call of a row."""
    if mode in SAGUARO_MODES:
        row_prog, row_mode = row_program(program, mode)
        out = row_prog.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, temperature=temperature,
                                seed=seed, mode=row_mode, eos_token_id=None)
        _synchronize(target)
        return int(out.stats["new_tokens"]), out
    produced = _hf_generate(target, draft if mode == "hf-assisted" else None, ids, mask, max_new_tokens,
                            temperature, k, pad_id, seed)
    _synchronize(target)
    return produced, None


def _ssd_summary(calls: list[dict], rounds: int) -> dict:
    """SSD columns over all measured calls: hit rate, draft wait per round, overlap efficiency."""
    lookups = sum(c["rounds"] for c in calls)
    mean = lambda key: sum(c[key] * c["rounds"] for c in calls) / lookups if lookups else 0.0  # noqa: E731
    return {
        "cache_hit_rate": mean("cache_hit_rate"),
        # the timed generations the planner ran as plain SD on every core (sd_when_faster)
        "planned_sd_fraction": sum(bool(c.get("planned_sd")) for c in calls) / len(calls) if calls else None,
        "planned_sd_calls": [sum(bool(c.get("planned_sd")) for c in calls), len(calls)],
        "draft_wait_ms_per_round": 1000 * sum(c["draft_wait_s"] for c in calls) / max(rounds, 1),
        "verify_ms_per_round": 1000 * sum(c["verify_s"] for c in calls) / max(rounds, 1),
        "fallback_ms_per_round": 1000 * sum(c["fallback_s"] for c in calls) / max(rounds, 1),
        "overlap_efficiency": mean("overlap_efficiency"),
        "verify_alone_ms": 1000 * mean("verify_alone_s"),
        "per_round_ms": {part: sum(c["per_round_ms"][part] * c["rounds"] for c in calls) / lookups
                         for part in calls[0]["per_round_ms"]} if lookups else {},
        "fallbacks": {kind: sum(c["fallbacks"][kind] for c in calls) for kind in ("neural", "fast")},
        "hits_by_position": {a: sum(c["hits_by_position"][a] for c in calls) for a in calls[0]["hits_by_position"]},
        "accepted_len_on_hits": _weighted(calls, "accepted_len_on_hits"),
        "accepted_len_on_misses": _weighted(calls, "accepted_len_on_misses"),
    }


def _weighted(calls, key):
    values = [(c[key], c["rounds"]) for c in calls if c.get(key) is not None]
    total = sum(w for _, w in values)
    return sum(v * w for v, w in values) / total if total else None


def _synchronize(model) -> None:
    """Wait for queued GPU work, so a row's wall time covers all of it (``model`` None: a loaded program's
    rows; they synchronise on the CPU already)."""
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
    kwargs = dict(attention_mask=mask, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                  pad_token_id=pad_id, eos_token_id=None)
    if temperature > 0:
        torch.manual_seed(seed)
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
    else:
        kwargs.update(do_sample=False)
    if assistant is not None:
        kwargs.update(assistant_model=assistant, num_assistant_tokens=k, num_assistant_tokens_schedule="constant")
    out = target.generate(ids, **kwargs)
    return int((out.shape[1] - ids.shape[1]) * ids.shape[0])


