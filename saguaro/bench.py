"""Benchmark: Saguaro's modes (AR, SD, and SSD once a build has it) against ``transformers``, in one run.

Rows: ``ar`` (Saguaro, target alone), ``sd`` (Saguaro speculative decoding), ``ssd`` (only where
the program supports it), ``hf-assisted`` (``transformers`` assisted generation with the same draft
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

SAGUARO_MODES = ("ar", "sd", "ssd")
HF_MODES = ("hf-assisted", "hf")
ALL_MODES = SAGUARO_MODES + HF_MODES
DRAFT_MODES = ("sd", "ssd", "hf-assisted")  # rows that run the draft
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
                             "ssd where this build has it, hf-assisted with --batch 1)")
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


def compile_for(target, draft, k: int, backend: str = "eager", want_ssd: bool = True):
    """One Program serving every Saguaro row: compiled for ``ssd`` when wanted (falling back to ``sd``
    where this build refuses it), ``sd`` with a draft, ``ar`` without one."""
    from saguaro.compile import compile as saguaro_compile

    start = time.perf_counter()
    program = None
    if draft is not None and want_ssd:
        try:
            program = saguaro_compile(target, draft, k=k, mode="ssd", backend=backend)
        except (ValueError, NotImplementedError) as exc:
            log.info("ssd does not compile in this build (%s); compiling for sd", exc)
    if program is None:
        program = saguaro_compile(target, draft, k=k, mode="sd" if draft is not None else "ar", backend=backend)
    log.info("compiled in %.1fs", time.perf_counter() - start)
    return program


def mode_available(program, mode: str, ids: torch.Tensor) -> bool:
    """Whether ``program.generate(..., mode=mode)`` runs in this build: a one-token probe from ``ids``."""
    if mode == "ar":
        return True
    if program.draft is None:
        return False
    try:
        program.generate(ids, max_new_tokens=1, mode=mode, eos_token_id=None)
    except (ValueError, NotImplementedError) as exc:
        log.info("mode %s is not available: %s", mode, exc)
        return False
    return True


def run_rows(target, draft, prompts, modes, k, max_new_tokens, temperature, batch, seed, backend="eager",
             program=None, skip_unavailable=False):
    """Run every requested row over the same prompts; return a list of result dicts.

    ``program`` reuses an already compiled Program (its ``k`` and backend win). A Saguaro mode this
    build does not run (``ssd`` today) raises ``ValueError``, or is left out of the rows with
    ``skip_unavailable=True``.
    """
    if program is None and any(m in SAGUARO_MODES for m in modes):
        program = compile_for(target, draft, k, backend, want_ssd="ssd" in modes)
    pad_id = program.pad_token_id if program is not None else _pad_id(target)
    warm = next(_batches(prompts, batch, pad_id))
    rows = []
    for mode in modes:
        if mode in SAGUARO_MODES and not mode_available(program, mode, warm[0][:1, -4:]):
            if skip_unavailable:
                log.info("skipping %s: not available in this build", mode)
                continue
            raise ValueError(f"mode {mode!r} is not available in this build of saguaro; "
                             f"choose rows from {', '.join(m for m in ALL_MODES if m != mode)}")
        log.info("running %s", mode)
        new_tokens, wall, accepted, rounds, hits = 0, 0.0, 0.0, 0, []
        for i, (ids, mask) in enumerate([warm] + list(_batches(prompts, batch, pad_id))):
            start = time.perf_counter()
            if mode in SAGUARO_MODES:
                out = program.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                       temperature=temperature, seed=seed, mode=mode, eos_token_id=None)
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
                hits.append(stats["cache_hit_rate"])
        row = {
            "mode": mode, "tokens_per_s": new_tokens / wall if wall else 0.0, "new_tokens": new_tokens,
            "wall_s": wall, "mean_accepted_len": accepted / rounds if rounds else None,
            "rounds": rounds if rounds else None,
        }
        if hits:
            row["cache_hit_rate"] = sum(hits) / len(hits)
        rows.append(row)
    ar = next((r["tokens_per_s"] for r in rows if r["mode"] == "ar"), None)
    for row in rows:
        row["speedup_vs_ar"] = row["tokens_per_s"] / ar if ar else None
    return rows


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
    """The rows as a text table: tokens/s, mean accepted length, speed-up over AR (and SSD's hit rate)."""
    with_hits = any(r.get("cache_hit_rate") is not None for r in rows)
    header = f"{'mode':<14}{'tokens/s':>10}{'accepted len':>14}{'speed-up vs AR':>16}"
    if with_hits:
        header += f"{'cache hits':>12}"
    lines = [header, "-" * len(header)]
    for r in rows:
        acc = f"{r['mean_accepted_len']:.2f}" if r["mean_accepted_len"] is not None else "-"
        sp = f"{r['speedup_vs_ar']:.2f}x" if r.get("speedup_vs_ar") is not None else "-"
        line = f"{r['mode']:<14}{r['tokens_per_s']:>10.1f}{acc:>14}{sp:>16}"
        if with_hits:
            hit = r.get("cache_hit_rate")
            line += f"{hit:>12.2f}" if hit is not None else f"{'-':>12}"
        lines.append(line)
    return "\n".join(lines)


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
    rows = run_rows(target, draft, prompts, modes, args.k, args.max_new_tokens, args.temperature, args.batch,
                    args.seed, backend=args.backend, skip_unavailable=not explicit)
    for mode in modes:
        if mode not in skipped and not any(r["mode"] == mode for r in rows):
            skipped[mode] = "not available in this build"
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
            "skipped": skipped,
        }
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(report, indent=2))
        tmp.replace(path)  # never leave a half-written report
        sys.stdout.write(f"wrote {path}\n")
    return 0
