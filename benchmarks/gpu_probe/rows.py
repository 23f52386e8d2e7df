"""One speed row: a program timed on one prompt, with what a user would want to know beside the speed.

A row runs the program once untimed (compiles every stage it needs, warms the lane up), then
``REPEATS`` timed generations (the median by tokens/s is the row's), then one more, untimed, with the
host-sync counter and the fan-out recorder on (their patches cost host time). Fields:

- ``tokens_per_s`` (prefill included), ``decode_tokens_per_s``, ``ms_per_round`` (decode time per round);
- ``bytes_per_round`` (:func:`~benchmarks.gpu_probe.models.round_bytes`), ``bytes_per_token`` (over the
  tokens decided per round) and ``roofline_share``: bytes per round over time per round over the copy
  bandwidth measured in the same part (1.0: every byte streamed at the copy's rate);
- ``launches_per_stage`` (kernels per stage call, counted from the generated code) and ``graphed_stages``;
- ``host_syncs_per_round`` (device-to-host reads per round, median over the rounds after the first);
- SD: ``c_measured``, one draft step's time over one verify's (``stats`` draft and verify seconds);
- SSD: ``hits_by_position``, ``cache_hit_rate``, ``fallbacks`` (by kind), ``plan``; ``fan_out_per_round`` from the
  counted generation, which ran as ``counted_ran``.
"""

from __future__ import annotations

import time

REPEATS = {"cuda": 3, "cpu": 1}  # timed generations per row after the first


def config_info(program) -> dict:
    names = (
        "mode",
        "backend",
        "attention",
        "linears",
        "cuda_graphs",
        "lane",
        "k",
        "sd_when_faster",
        "fan_out",
    )
    return {n: getattr(program.config, n) for n in names if hasattr(program.config, n)}


def measure(program, ids, args, label: str, part: dict) -> dict:
    """The row ``label`` of ``program`` on ``ids``; ``part`` holds ``bandwidth`` and ``pair`` (models)."""
    from . import counting
    from .models import acceptance, pair_bytes, round_bytes

    started = time.perf_counter()
    program.generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=None)
    first_s = time.perf_counter() - started
    runs = [
        program.generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=None)
        for _ in range(REPEATS.get(ids.device.type, 1))
    ]
    out = sorted(runs, key=lambda o: o.stats["tokens_per_s"])[len(runs) // 2]
    stats = out.stats
    rounds = max(stats.get("rounds", 0), 1)
    decode_s = stats["wall_s"] - stats.get("prefill_s", 0.0)
    ms_per_round = 1000 * decode_s / rounds
    batch = ids.shape[0]
    ran = ran_as(stats)
    pair = part["pair"]
    bytes_b = pair_bytes(args.scale, args.target_layers, pair["dtype_bytes"], pair["context"], batch)
    per_round = round_bytes(ran, program.config.k, bytes_b)
    tokens_per_round = (
        max(stats.get("new_tokens", 0) - batch, 1) / rounds
    )  # the prefill gives each row its first
    bandwidth = (part.get("bandwidth") or {}).get("bytes_per_s")
    entry = {
        "row": label,
        "mode": program.config.mode,
        "ran": ran,
        "batch": batch,
        "status": "ok",
        "config": config_info(program),
        "first_call_s": round(first_s, 2),
        "tokens_per_s": round(stats["tokens_per_s"], 2),
        "tokens_per_s_all": [round(o.stats["tokens_per_s"], 2) for o in runs],
        "decode_tokens_per_s": round(stats.get("decode_tokens_per_s", 0.0), 2),
        "ms_per_round": round(ms_per_round, 4),
        "rounds": stats.get("rounds"),
        "mean_accepted_len": round(stats.get("mean_accepted_len", 0.0), 3),
        "round_ms_p50": stats.get("round_ms_p50"),
        "per_round_ms": stats.get("per_round_ms"),
        "bytes_per_round": per_round,
        "bytes_per_token": round(per_round / tokens_per_round),
        "roofline_share": _sig(per_round / (ms_per_round / 1000) / bandwidth)
        if bandwidth and ms_per_round > 0
        else None,
    }
    if ran != "ar":
        entry["acceptance"] = acceptance(out.counters, program.config.k)
    if ran == "sd" and stats.get("draft_s") and stats.get("verify_s"):
        step = stats["draft_s"] / (rounds * program.config.k)
        entry["c_measured"] = _sig(step / (stats["verify_s"] / rounds))
        entry["stage_ms"] = {
            "draft_step": round(1000 * step, 4),
            "verify": round(1000 * stats["verify_s"] / rounds, 4),
        }
    if "cache_hit_rate" in stats:
        entry |= {
            "cache_hit_rate": round(stats["cache_hit_rate"], 4),
            "hits_by_position": stats.get("hits_by_position"),
            "fallbacks": stats.get("fallbacks"),
            "planned_sd": stats.get("planned_sd"),
            "plan": stats.get("plan"),
            "overlap_efficiency": round(stats.get("overlap_efficiency", 0.0), 4),
            "lane": stats.get("lane"),
            "lane_failures": stats.get("lane_failures"),
            "draft_wait_ms_per_round": round(1000 * stats.get("draft_wait_s", 0.0) / rounds, 4),
        }
    graphs = {
        k: v for k, v in stats.items() if "graph" in k
    }  # what the build says of its CUDA graphs, if anything
    if graphs:
        entry["graph_stats"] = graphs
    entry |= counting.program_launches(program)
    entry |= counted_generation(program, ids, args)
    return entry


def ran_as(stats: dict) -> str:
    """What a generation ran as: its mode, or ``"sd"`` where the planner ran SSD's generation as SD's rounds."""
    return "sd" if stats.get("planned_sd") or stats.get("ran_as") == "sd" else stats.get("mode")


def _sig(x: float, digits: int = 4) -> float:
    """``x`` to ``digits`` significant digits (a small share stays above zero)."""
    return float(f"{x:.{digits}g}")


def counted_generation(program, ids, args) -> dict:
    """Host syncs per round and (SSD) the fan-out per round, from one more generation, and what that generation
    ran as (``counted_ran``: the planner decides per generation, so it may differ from the timed one's)."""
    from . import counting

    with counting.fan_outs() as seen, counting.SyncCounter() as syncs:
        out = program.generate(ids, max_new_tokens=args.max_new_tokens, eos_token_id=None)
    found = syncs.summary(out.stats.get("rounds", 0)) | {"counted_ran": ran_as(out.stats)}
    if program.config.mode == "ssd":
        found |= counting.fan_out_summary(seen)
    return found


def error_entry(label: str, exc: BaseException) -> dict:
    return {"row": label, "status": f"error: {type(exc).__name__}: {str(exc)[:500]}"}
