"""Benchmark: Saguaro's modes (AR, SD, SSD) against ``transformers``, in one run.

Rows: ``ar`` (Saguaro, target alone), ``sd`` (Saguaro speculative decoding), ``ssd`` (geometric
fan-out, draft on a worker thread), ``ssd-uniform`` (the same budget spread evenly over the ``k+1``
positions), ``ssd-process`` (geometric, draft in another process over gloo), ``hf-assisted`` (``transformers`` assisted generation with the same draft
and ``k``) and ``hf`` (``transformers`` greedy/sampled generate, target alone). Prints a table
(tokens/s, mean accepted length, speed-up over AR) and writes JSON. Speed is only ever compared as
ratios within one run on one machine.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SAGUARO_MODES = ("ar", "sd", "ssd", "ssd-uniform", "ssd-process")
HF_MODES = ("hf-assisted", "hf")
ALL_MODES = SAGUARO_MODES + HF_MODES
DRAFT_MODES = ("sd", "ssd", "ssd-uniform", "ssd-process", "hf-assisted")  # rows that run the draft
# Code prompts without a trailing space: byte-level BPE fuses a space to the next word, so a prompt
# ending in one ("def ") is tokenized unlike any training text and hurts every row alike.
DEFAULT_PROMPTS = (
    "def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\nimport sys\n\n\ndef main():\n",
    "for i in range(10):\n", "if __name__ == \"__main__\":\n", "    def __repr__(self):\n        return",
    "with open(path) as f:\n", "try:\n    import json\nexcept ImportError:\n", "from collections import",
    "def read_lines(path):\n    \"\"\"Return the lines of a file.\"\"\"\n", "    raise ValueError(",
    "def is_prime(n):\n",
)


def modes_arg(text: str) -> list[str]:
    """An argparse ``type``: comma-separated row names, each one of :data:`ALL_MODES`."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(
            f"--modes {text!r} is not allowed ({', '.join(map(repr, unknown)) or 'empty'}): "
            f"choose from {', '.join(ALL_MODES)}")
    return list(dict.fromkeys(modes))  # keep order, drop repeats


def add_bench_args(parser) -> None:
    from saguaro.cli import int_at_least

    parser.add_argument("--prompts", type=int_at_least(1, "prompts"), default=8,
                        help="number of prompts (default 8)")
    parser.add_argument("--batch", type=int_at_least(1, "batch"), default=1,
                        help="prompts per generate call (default 1)")
    parser.add_argument("--modes", type=modes_arg, default=None,
                        help=f"comma-separated rows, from {', '.join(ALL_MODES)} (default: every row that applies: "
                             "hf-assisted only with --batch 1)")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the results here as JSON")
    parser.add_argument("--seed", type=int, default=0, help="seed for sampling and for random prompts")
    parser.add_argument("--threads", type=int_at_least(1, "threads"), default=None,
                        help="torch intra-op threads (default: torch's)")


def bench_prompts(tokenizer, count: int, vocab_size: int, seed: int) -> list[torch.Tensor]:
    """Prompts as ``[1, T]`` id tensors: held-out text when a tokenizer exists, else seeded random ids."""
    if tokenizer is not None:
        texts = _heldout_prompts(count) or list(DEFAULT_PROMPTS)
        return [tokenizer(texts[i % len(texts)], return_tensors="pt").input_ids for i in range(count)]
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (1, 8), generator=gen) for _ in range(count)]


def _heldout_prompts(count: int) -> list[str]:
    try:
        from saguaro.default_pair import heldout_prompts
    except ImportError:
        return []
    try:
        return heldout_prompts(count)
    except Exception as exc:  # the stdlib corpus may be absent; fall back to fixed prompts
        log.warning("held-out prompts unavailable (%s); using fixed prompts", exc)
        return []


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


def compile_for(target, draft, k: int, backend: str = "eager"):
    """One Program serving every Saguaro row (``ssd`` with a draft, ``ar`` without one)."""
    from saguaro.compile import compile as saguaro_compile

    start = time.perf_counter()
    program = saguaro_compile(target, draft, k=k, mode="ssd" if draft is not None else "ar", backend=backend)
    log.info("compiled in %.1fs", time.perf_counter() - start)
    return program


def row_program(program, mode: str):
    """The program and the ``generate`` mode of a Saguaro row."""
    if mode == "ssd-uniform":
        per_position = max(1, program.config.budget // (program.config.k + 1))
        return program.variant(fan_out=per_position), "ssd"
    if mode == "ssd":
        return program.variant(fan_out="geometric", lane="thread"), "ssd"
    if mode == "ssd-process":
        return program.variant(fan_out="geometric", lane="process"), "ssd"
    return program, mode


def run_rows(target, draft, prompts, modes, k, max_new_tokens, temperature, batch, seed, backend="eager",
             program=None):
    """Run every requested row over the same prompts; return a list of result dicts.

    ``program`` reuses an already compiled Program (its ``k`` and backend win).
    """
    if program is None and any(m in SAGUARO_MODES for m in modes):
        program = compile_for(target, draft, k, backend)
    pad_id = program.pad_token_id if program is not None else _pad_id(target)
    warm = next(_batches(prompts, batch, pad_id))
    rows = []
    for mode in modes:
        if mode in DRAFT_MODES and mode in SAGUARO_MODES and (program is None or program.draft is None):
            raise ValueError(f"row {mode!r} needs a draft model")
        log.info("running %s", mode)
        new_tokens, wall, accepted, rounds, ssd = 0, 0.0, 0.0, 0, []
        for i, (ids, mask) in enumerate([warm] + list(_batches(prompts, batch, pad_id))):
            start = time.perf_counter()
            if mode in SAGUARO_MODES:
                row_prog, row_mode = row_program(program, mode)
                out = row_prog.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                        temperature=temperature, seed=seed, mode=row_mode, eos_token_id=None)
                produced, stats = int(out.stats["new_tokens"]), out.stats
            else:
                produced, stats = _hf_generate(target, draft if mode == "hf-assisted" else None, ids, mask,
                                               max_new_tokens, temperature, k, pad_id, seed), {}
            _synchronize(target)
            elapsed = time.perf_counter() - start
            if i == 0:
                continue  # warm-up
            new_tokens += produced
            wall += elapsed
            if stats.get("rounds"):
                # weight each call's mean by its rounds, so the row's mean is per round
                accepted += stats["mean_accepted_len"] * stats["rounds"]
                rounds += stats["rounds"]
            if stats.get("cache_hit_rate") is not None:
                ssd.append(stats)
        row = {
            "mode": mode, "tokens_per_s": new_tokens / wall if wall else 0.0, "new_tokens": new_tokens,
            "wall_s": wall, "mean_accepted_len": accepted / rounds if rounds else None,
            "rounds": rounds if rounds else None,
        }
        if ssd:
            row.update(_ssd_summary(ssd, rounds))
        rows.append(row)
    ar = next((r["tokens_per_s"] for r in rows if r["mode"] == "ar"), None)
    for row in rows:
        row["speedup_vs_ar"] = row["tokens_per_s"] / ar if ar else None
    return rows


def _ssd_summary(calls: list[dict], rounds: int) -> dict:
    """SSD columns over all measured calls: hit rate, draft wait per round, overlap efficiency."""
    lookups = sum(c["rounds"] for c in calls)
    mean = lambda key: sum(c[key] * c["rounds"] for c in calls) / lookups if lookups else 0.0  # noqa: E731
    return {
        "cache_hit_rate": mean("cache_hit_rate"),
        "draft_wait_ms_per_round": 1000 * sum(c["draft_wait_s"] for c in calls) / max(rounds, 1),
        "verify_ms_per_round": 1000 * sum(c["verify_s"] for c in calls) / max(rounds, 1),
        "fallback_ms_per_round": 1000 * sum(c["fallback_s"] for c in calls) / max(rounds, 1),
        "overlap_efficiency": mean("overlap_efficiency"),
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
    """Wait for queued GPU work, so a row's wall time covers all of it."""
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


def compile_and_warm(target, draft, prompts, modes, args, backend):
    """Compile for ``backend`` and run every mode on two prompt lengths, so that capture, stage building
    and (inductor) compilation, static and dynamic, all happen before any timed row. Returns
    ``(program, seconds)``."""
    started = time.perf_counter()
    program = compile_for(target, draft if any(m in DRAFT_MODES for m in modes) else None, args.k, backend)
    warm = list(_batches(prompts[:2], 1, program.pad_token_id))
    warm += list(_batches(prompts[:args.batch], args.batch, program.pad_token_id))
    for mode in modes:
        row_prog, row_mode = row_program(program, mode)
        for ids, mask in warm:
            row_prog.generate(ids, attention_mask=mask, max_new_tokens=args.max_new_tokens,
                              temperature=args.temperature, seed=args.seed, mode=row_mode, eos_token_id=None)
    return program, time.perf_counter() - started


def cmd_bench(args) -> int:
    import sys

    from saguaro.models_io import DTYPES, load_pair

    explicit = args.modes is not None
    modes = list(args.modes) if explicit else list(ALL_MODES)
    skipped = {}
    if args.batch > 1 and "hf-assisted" in modes:
        reason = "transformers' assisted generation runs one sequence at a time (--batch 1)"
        if explicit:
            raise ValueError(f"--modes hf-assisted is not allowed with --batch {args.batch}: {reason}")
        modes.remove("hf-assisted")
        skipped["hf-assisted"] = reason
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    need_draft = any(m in DRAFT_MODES for m in modes)
    target, draft, tokenizer = load_pair(args.target, args.draft, need_draft=need_draft, dtype=DTYPES[args.dtype],
                                         device=args.device)
    if not need_draft:
        draft = None
    prompts = bench_prompts(tokenizer, args.prompts, target.config.vocab_size, args.seed)
    backends = ["eager", "inductor"] if args.backend == "both" else [args.backend]
    rows, compile_s = [], {}
    for backend in backends:
        saguaro_modes = [m for m in modes if m in SAGUARO_MODES]
        hf_modes = [m for m in modes if m in HF_MODES] if backend == backends[0] else []
        program = None
        if saguaro_modes:
            program, compile_s[backend] = compile_and_warm(target, draft, prompts, saguaro_modes, args, backend)
            sys.stdout.write(f"{backend}: capture + compile + warm-up of every stage took {compile_s[backend]:.1f}s\n")
        part = run_rows(target, draft, prompts, saguaro_modes + hf_modes, args.k, args.max_new_tokens,
                        args.temperature, args.batch, args.seed, backend=backend, program=program)
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
    sys.stdout.write(format_table(rows) + "\n")
    for mode, reason in skipped.items():
        sys.stdout.write(f"skipped {mode}: {reason}\n")
    if args.json:
        report = {
            "config": {"k": args.k, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                       "prompts": args.prompts, "batch": args.batch, "backend": args.backend,
                       "device": args.device, "dtype": args.dtype,
                       "target": args.target or "default", "draft": args.draft or "default"},
            "machine": {"platform": platform.platform(), "torch": torch.__version__,
                        "threads": torch.get_num_threads()},
            "rows": rows,
            "compile_s": compile_s,
            "skipped": skipped,
        }
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(report, indent=2))
        tmp.replace(path)  # never leave a half-written report
        sys.stdout.write(f"wrote {path}\n")
    return 0
