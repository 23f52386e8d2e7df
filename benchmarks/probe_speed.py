"""The probe's speed phase: AR, SD and SSD at batch 1 and 8 on a pair whose acceptance is realistic.

The target has Llama-3.1-8B's widths (``--scale full``; tiny widths for a CPU run) and
``--target-layers`` layers, random weights (seeded). The draft is the target's embeddings, first layer,
final norm and head, copied. The target's other layers write into the residual stream through
``o_proj`` and ``down_proj``; both are scaled by one knob ``s`` (0: the target is the draft), tuned by
bisection until the draft's greedy agreement with the target over random contexts is near
``--acceptance``. The measured agreement, and the per-token acceptance of the real SD run, are
recorded. Rows: ``ar``, ``sd``, ``ssd`` (``sd_when_faster=False``: SSD's own rounds, the planner picking
each tree) and ``ssd_planner`` (the default: the planner may run SD when no tree pays, ``planned_sd``).
Each row's first generation per batch compiles; the timed one is the median of ``REPEATS``.
"""

from __future__ import annotations

import time

from probe_exactness import truncated

SHAPES = {
    "full": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                 vocab_size=128256, rms_norm_eps=1e-5, bos_token_id=128000, eos_token_id=128001,
                 rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=1,
                 vocab_size=512, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False),
}
ROWS = {"ar": {"mode": "ar"}, "sd": {"mode": "sd"}, "ssd": {"mode": "ssd", "sd_when_faster": False},
        "ssd_planner": {"mode": "ssd", "sd_when_faster": True}}
BATCHES = (1, 8)
REPEATS = {"cuda": 3, "cpu": 1}  # timed generations per row after the first (median)
OVERLAP_RESERVE_S = 45.0  # left for the overlap phase, which runs after this one in the same unit


def build_pair(args, device, dtype):
    """``target, draft, knob``: ``knob(s)`` scales the target's layers after the first by ``s``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[args.scale], num_hidden_layers=args.target_layers, pad_token_id=0,
                         max_position_embeddings=args.prompt_len + args.max_new_tokens + 256)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # initialised in the target dtype: no float32 copy of the big matrices
    try:
        with torch.device(device):
            target = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    draft = truncated(target, 1)
    writes = [w for layer in target.model.layers[1:]  # what the later layers add to the residual stream
              for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight)]
    originals = [w.detach().clone() for w in writes]

    def knob(s: float) -> None:
        with torch.no_grad():
            for w, original in zip(writes, originals):
                w.copy_(original * s)
    return target, draft, knob


def agreement(target, draft_tokens, contexts) -> float:
    """The fraction of positions where the target's greedy token is the draft's."""
    import torch

    with torch.inference_mode():
        return float((target(contexts).logits.argmax(-1) == draft_tokens).float().mean())


def tune(target, draft, knob, goal: float, vocab: int, device) -> dict:
    """Bisect the knob (geometrically) for greedy agreement ``goal`` on random contexts."""
    import torch

    contexts = torch.randint(3, vocab, (4, 64), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.inference_mode():
        draft_tokens = draft(contexts).logits.argmax(-1)
    history = []

    def measure(s):
        knob(s)
        history.append((s, agreement(target, draft_tokens, contexts)))
        return history[-1][1]

    lo, hi, s = None, None, 1.0  # lo: agreement >= goal; hi: below it
    for _ in range(12):
        if measure(s) >= goal:
            lo = s
            s = s * 4 if hi is None else (s * hi) ** 0.5
        else:
            hi = s
            s = s / 4 if lo is None else (lo * s) ** 0.5
        if lo is not None and hi is not None and hi / lo < 1.15:
            break
    best_s, best = min(history, key=lambda h: abs(h[1] - goal))
    knob(best_s)
    return {"goal": goal, "rest_scale": best_s, "agreement": round(best, 4), "contexts": list(contexts.shape),
            "history": [(round(s, 5), round(a, 4)) for s, a in history]}


def acceptance(counters, k: int) -> float | None:
    """Per-token greedy acceptance of a speculative run: accepted / offered, per row and round."""
    decided = list(getattr(counters, "accepted_lengths", []) or [])
    offered = sum(min(d, k) for d in decided)
    return round(sum(d - 1 for d in decided) / offered, 4) if offered else None


def compile_program(args, ctx):
    """The speed pair compiled for SSD (the rows are its variants); kept in ``ctx`` for overlap."""
    import torch

    import saguaro
    from probe_exactness import split_options

    if "speed_program" in ctx:
        return ctx["speed_program"]
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target, draft, knob = build_pair(args, device, dtype)
    tuning = tune(target, draft, knob, args.acceptance, target.config.vocab_size, device)
    options, missing = split_options({"cuda_graphs": True} if args.cuda_graphs else {})
    started = time.perf_counter()
    program = saguaro.compile(target, draft, k=args.k, mode="ssd", backend=args.speed_backend, lane="thread",
                              **options)
    params = {name: sum(p.numel() for p in m.parameters()) for name, m in (("target", target), ("draft", draft))}
    ctx["speed_program"] = program
    effective = {name: getattr(program.config, name) for name in ("backend", "attention", "cuda_graphs", "lane")
                 if hasattr(program.config, name)}
    ctx["speed_info"] = {
        "models": {"target_layers": args.target_layers, "draft_layers": 1, "dtype": str(dtype).removeprefix("torch."),
                   "params": params, "draft_to_target_params": round(params["draft"] / params["target"], 3),
                   "widths": {k: v for k, v in SHAPES[args.scale].items() if k.endswith("size") or "heads" in k}},
        "tuning": tuning, "capture_s": round(time.perf_counter() - started, 2),
        "config": {"backend": args.speed_backend, "k": args.k, "lane": "thread", "prompt_len": args.prompt_len,
                   "max_new_tokens": args.max_new_tokens, **options,
                   **{name: "not available in this build" for name in missing}, "effective": effective},
    }
    return program


def prompt(batch: int, vocab: int, length: int, device):
    import torch

    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(batch)).to(device)


def run(args, ctx, record, deadline: float) -> dict:
    program = compile_program(args, ctx)
    result = dict(ctx["speed_info"], rows=[])
    record(result)
    vocab = program.target.spec.vocab_size
    own_deadline = deadline - (OVERLAP_RESERVE_S if "overlap" in args.phases.split(",") else 0.0)
    device = program.target.spec.device
    for batch in BATCHES:
        ids = prompt(batch, vocab, args.prompt_len, device)
        for row, changes in ROWS.items():
            entry = {"batch": batch, "row": row}
            result["rows"].append(entry)
            if time.time() > own_deadline:
                entry["status"] = "skipped: time budget"
                continue
            try:
                entry.update(time_row(program.variant(**changes), ids, args))
            except Exception as exc:  # noqa: BLE001 - one row's failure is recorded; the others run
                entry["status"] = f"error: {type(exc).__name__}: {str(exc)[:500]}"
            record(result)
    if any(r.get("status", "ok") != "ok" for r in result["rows"]):
        result["status"] = "partial: some rows skipped or failed (see rows)"
    return result


def time_row(program, ids, args) -> dict:
    """The first generation (compiles, warms the lane up), then the median of ``REPEATS`` timed ones."""
    started = time.perf_counter()
    program.generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=None)
    warm_s = time.perf_counter() - started
    repeats = REPEATS.get(ids.device.type, 1)
    runs = [program.generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=None) for _ in range(repeats)]
    out = sorted(runs, key=lambda o: o.stats["tokens_per_s"])[len(runs) // 2]
    stats = out.stats
    rounds = max(stats.get("rounds", 0), 1)
    entry = {"status": "ok", "first_call_s": round(warm_s, 2), "tokens_per_s": round(stats["tokens_per_s"], 1),
             "tokens_per_s_all": [round(o.stats["tokens_per_s"], 1) for o in runs],
             "ms_per_round": round(1000 * (stats["wall_s"] - stats.get("prefill_s", 0.0)) / rounds, 3),
             "rounds": stats.get("rounds"), "mean_accepted_len": round(stats.get("mean_accepted_len", 0.0), 3),
             "ran": stats.get("mode"), "round_ms_p50": stats.get("round_ms_p50")}
    if program.config.mode != "ar":
        entry["acceptance"] = acceptance(out.counters, program.config.k)
    if "cache_hit_rate" in stats:
        entry |= {"cache_hit_rate": round(stats["cache_hit_rate"], 3), "planned_sd": stats.get("planned_sd"),
                  "plan": stats.get("plan"), "overlap_efficiency": round(stats.get("overlap_efficiency", 0.0), 3),
                  "draft_wait_ms_per_round": round(1000 * stats.get("draft_wait_s", 0.0) / rounds, 3),
                  "lane": stats.get("lane"), "lane_failures": stats.get("lane_failures")}
    return entry
