"""Part D, exactness: tiny float32 pairs, greedy outputs against ``transformers`` ``generate`` and
sampled outputs checked for validity, under one configuration per sub-phase (:data:`CONFIGS`).

Each check is ``{"name", "ok", ...}``: ``ok`` is token equality with ``generate`` (greedy) or validity
(sampled: the shape, the prompt kept, every token in the vocabulary, the same seed giving the same
tokens, and the process lane giving the thread lane's tokens for a seed), and in both cases that the
generation ran the path the check names (``ran_as_asked``: SSD's own rounds on the lane asked for, not
SD after a lane failure). A greedy mismatch records
where it diverged and the target's top-2 logit margin there (a near tie points at rounding, a wide one
at a bug). Checks run most telling first; past the deadline the rest are recorded as skipped.
"""

from __future__ import annotations

import time
import traceback

K, NEW, PROMPT_LEN, VOCAB, PAD = 3, 16, 9, 128, 0
BATCHES = {1: {}, 3: {1: 4, 2: 1}}  # batch -> {row: left-padding}
CONFIGS = {
    "inductor_cuda_graphs": {"backend": "inductor", "cuda_graphs": True},
    "inductor_cuda_graphs_flex": {"backend": "inductor", "attention": "flex", "cuda_graphs": True},
    "inductor": {"backend": "inductor"},
    "eager": {"backend": "eager"},
}
CUDA_ONLY = ("inductor_cuda_graphs", "inductor_cuda_graphs_flex")
SLACK_S = 5.0  # a check is not started with less than this left


def tiny_pair(arch: str, device, seed: int = 0):
    """A random 2-layer target and a draft of its first layer (shared weights copied), float32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[arch]
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    target = model_cls(config).eval()
    from .models import truncated

    return target.to(device), truncated(target, 1).to(device)


def prompts(batch: int, device, seed: int):
    """``input_ids, attention_mask [batch, PROMPT_LEN]``, rows left-padded as BATCHES says."""
    import torch

    ids = torch.randint(3, VOCAB, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    for row, count in BATCHES[batch].items():
        ids[row, :count], mask[row, :count] = PAD, 0
    return ids.to(device), mask.to(device)


def split_options(options: dict) -> tuple[dict, list]:
    """The options this build's SaguaroConfig has, and the names of those it lacks."""
    import dataclasses

    from saguaro.core.config import SaguaroConfig

    fields = {f.name for f in dataclasses.fields(SaguaroConfig)}
    return {k: v for k, v in options.items() if k in fields}, [k for k in options if k not in fields]


def run(sub: str, args, record, deadline: float) -> dict:
    import torch

    import saguaro

    options, missing = split_options(CONFIGS[sub])
    shown = {**options, **{name: "not available in this build" for name in missing}}
    device = torch.device(args.device)
    checks, skipped = [], []
    result = {"options": shown, "checks": checks, "skipped": skipped, "k": K, "new_tokens": NEW}
    pairs = (args.pairs if sub == "eager" else args.compiled_pairs).split(",")
    result["pairs"] = pairs
    for arch in pairs:
        target, draft = tiny_pair(arch, device)
        started = time.perf_counter()
        base = saguaro.compile(
            target, draft, k=K, mode="sd", fan_out="geometric", lane="thread", sd_when_faster=False, **options
        )
        result.setdefault("capture_s", {})[arch] = round(time.perf_counter() - started, 2)
        programs = {
            "ar": base.variant(mode="ar"),
            "sd": base,
            "ssd_thread": base.variant(mode="ssd"),
            "ssd_process": base.variant(mode="ssd", lane="process"),
            "ssd_fan_out_0": base.variant(mode="ssd", fan_out=0, fallback="neural"),
        }
        try:
            for label, batch, fn in plan(programs):
                name = f"{arch}/b{batch}/{label}"
                if time.time() > deadline - SLACK_S:
                    skipped.append(name)
                    continue
                started = time.perf_counter()
                try:
                    check = fn(target, batch, device)
                except Exception as exc:
                    check = {
                        "ok": False,
                        "error": f"{type(exc).__name__}: {str(exc)[:500]}",
                        "traceback": traceback.format_exc()[-3000:],
                    }
                checks.append({"name": name, **check, "s": round(time.perf_counter() - started, 2)})
                record({"checks": checks, "skipped": skipped})
        finally:
            base.close()
    false = sum(1 for c in checks if not c["ok"])
    notes = ([f"{false} of {len(checks)} checks false"] if false else []) + (
        [f"{len(skipped)} checks skipped (time budget)"] if skipped else []
    )
    if notes:
        result["status"] = ("false: " if false else "partial: ") + "; ".join(notes)
    return result


def plan(programs: dict):
    """``(label, batch, check function)`` in the order they run: greedy thread-lane checks first."""
    for batch in BATCHES:
        for label in ("ar", "sd", "ssd_thread", "ssd_fan_out_0"):
            yield f"greedy_{label}", batch, _greedy(programs[label])
    for batch in BATCHES:
        yield "greedy_ssd_process", batch, _greedy(programs["ssd_process"])
    for batch in BATCHES:
        for label in ("ar", "sd", "ssd_thread"):
            yield f"sampled_{label}", batch, _sampled(programs[label])
        yield "sampled_ssd_process", batch, _sampled(programs["ssd_process"], programs["ssd_thread"])


_REFERENCES: dict = {}  # (target, batch) -> generate's greedy output, computed once


def reference(target, ids, mask, batch):
    import torch

    key = (id(target), batch)
    if key not in _REFERENCES:
        with torch.no_grad():
            _REFERENCES[key] = (
                target,
                target.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=NEW,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=PAD,
                ),
            )
    return _REFERENCES[key][1]


def _greedy(program):
    def check(target, batch, device):
        import torch

        ids, mask = prompts(batch, device, seed=batch)
        expected = reference(target, ids, mask, batch)
        out = program.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None)
        equal = out.sequences.shape == expected.shape and bool(
            torch.equal(out.sequences.cpu(), expected.cpu())
        )
        stats = out.stats
        found = {
            "equal": equal,
            "ran_as_asked": ran_as_asked(program, stats),
            "ran": stats.get("mode"),
            "lane": stats.get("lane"),
            "rounds": stats.get("rounds"),
            "mean_accepted_len": _round(stats.get("mean_accepted_len")),
        }
        if "cache_hit_rate" in stats:
            found |= {
                "cache_hit_rate": _round(stats["cache_hit_rate"]),
                "lane_failures": stats.get("lane_failures"),
                "planned_sd": stats.get("planned_sd"),
            }
        if not equal:
            found["first_mismatch"] = first_mismatch(target, expected, out.sequences, mask)
        return {"ok": equal and found["ran_as_asked"], **found}

    return check


def ran_as_asked(program, stats: dict) -> bool:
    """The generation ran the path its check names: for SSD its own rounds (no lane failure finishing
    it as SD, no plan of SD) on the lane asked for (a process lane that cannot start falls back to the
    thread lane), and with ``fan_out=0`` not one hit."""
    config = program.config
    if config.mode != "ssd":
        return stats.get("mode") == config.mode
    ran = stats.get("mode") == "ssd" and "cache_hit_rate" in stats and not stats.get("planned_sd")
    ran = ran and not stats.get("lane_failures") and stats.get("lane") == config.lane
    return bool(ran and (config.fan_out != 0 or stats.get("cache_hit_rate") == 0.0))


def _sampled(program, reference=None):
    """Valid: shape, prompt kept, tokens in the vocabulary, repeatable for a seed (or, with a
    ``reference`` program, the same tokens as it gives for the seed)."""

    def check(target, batch, device):
        import torch

        ids, mask = prompts(batch, device, seed=10 + batch)
        kwargs = dict(attention_mask=mask, max_new_tokens=NEW, temperature=1.0, seed=7, eos_token_id=None)
        out = program.generate(ids, **kwargs)
        again = (reference or program).generate(ids, **kwargs)
        seqs = out.sequences
        facts = {
            "shape": tuple(seqs.shape) == (batch, PROMPT_LEN + NEW),
            "prompt_kept": bool(torch.equal(seqs[:, :PROMPT_LEN].cpu(), ids.cpu())),
            "in_vocabulary": bool(((seqs >= 0) & (seqs < VOCAB)).all()),
            "same_tokens_for_seed" if reference is None else "same_as_thread_lane": bool(
                torch.equal(seqs.cpu(), again.sequences.cpu())
            ),
        }
        facts["ran_as_asked"] = ran_as_asked(program, out.stats)
        return {
            "ok": all(facts.values()),
            **facts,
            "ran": out.stats.get("mode"),
            "lane": out.stats.get("lane"),
            "lane_failures": out.stats.get("lane_failures"),
        }

    return check


def first_mismatch(target, expected, got, mask) -> dict:
    """Where ``got`` first leaves ``expected``, and the target's top-2 logit margin at that token."""
    import torch

    differ = (expected.cpu() != got.cpu()).nonzero() if got.shape == expected.shape else None
    if differ is None or len(differ) == 0:
        return {"shape": [list(expected.shape), list(got.shape)]}
    row, pos = (int(x) for x in differ[0])
    full_mask = torch.cat([mask, torch.ones_like(expected[:, mask.shape[1] :])], dim=1)[row : row + 1, :pos]
    with torch.no_grad():
        logits = (
            target(
                expected[row : row + 1, :pos],
                attention_mask=full_mask,
                position_ids=(full_mask.cumsum(-1) - 1).clamp_min(0),
            )
            .logits[0, -1]
            .float()
        )
    top = logits.topk(2).values
    return {
        "row": row,
        "position": pos,
        "expected": int(expected[row, pos]),
        "got": int(got[row, pos]),
        "top2_margin": round(float(top[0] - top[1]), 6),
    }


def _round(x, digits=3):
    return None if x is None else round(float(x), digits)
