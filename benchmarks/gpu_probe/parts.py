"""The probe's parts: each ``fn(args, ctx, record, deadline, hang) -> dict``, useful alone.

``record(dict)`` writes the part's results so far into the report at once (a part cut short keeps
them); ``deadline`` (``time.time()`` seconds) is when its rows stop starting; ``ctx`` holds the part's
pair and programs; ``hang`` (testing only) stalls the part once its first measurements are written.
"""

from __future__ import annotations

import time
from pathlib import Path

from . import hardware, models, rows, trace

TITLES = {
    "A": "environment, copy bandwidth, micro-benchmarks, AR at batch 1 with CUDA graphs off and on",
    "B": "SD at batch 1 with CUDA graphs on and off (then AR, time permitting)",
    "C": "SSD and its overlap at batch 1",
    "D": "exactness (greedy first, then sampled validity)",
    "E": "batch 8: AR, SD, SSD",
}
SLACK_S = 10.0  # a row is not started with less than this left
MICRO_S = 60.0  # the most part A's micro-benchmarks may take
DEFAULT = None  # the build's own cuda_graphs default (what a user gets)


def _start(args, ctx, record) -> dict:
    """Every part's head: the environment and the copy bandwidth, written at once."""
    import torch

    result = {"environment": hardware.environment(args)}
    record(result)
    result["bandwidth"] = hardware.bandwidth(torch.device(args.device))
    record(result)
    return result


STAGE_CHANGES = ("attention",)  # options that shape the stages: a program compiled of its own


def program(args, ctx: dict, graphs, **changes):
    """The part's pair compiled once per ``cuda_graphs`` setting (``DEFAULT``: not passed) and stage options
    (``attention``), as a variant with the runtime ``changes``."""
    import saguaro

    programs = ctx.setdefault("programs", {})
    shaping = {name: changes.pop(name) for name in STAGE_CHANGES if name in changes}
    key = str(graphs) + "".join(f" {name}={value}" for name, value in sorted(shaping.items()))
    if key not in programs:
        pair = models.make_pair(args, ctx)
        options = ({} if graphs is DEFAULT else {"cuda_graphs": graphs}) | shaping
        started = time.perf_counter()
        programs[key] = saguaro.compile(
            pair["target"],
            pair["draft"],
            k=args.k,
            mode="ssd",
            backend=args.backend,
            lane="thread",
            **options,
        )
        ctx.setdefault("capture_s", {})[key] = round(time.perf_counter() - started, 2)
    return programs[key].variant(**changes)


def speed_rows(name, args, ctx, result, record, deadline, plan, hang=None) -> dict:
    """``plan``: ``(label, cuda_graphs, batch, changes)`` rows in order; the trace after the first timed one.
    ``hang`` (testing) is called once the first measured row is written."""
    from saguaro.core.errors import ConfigError

    pair = models.make_pair(args, ctx)
    result["models"] = pair["info"]
    part = {"pair": pair, "bandwidth": result["bandwidth"]}
    result["rows"] = []
    for label, graphs, batch, changes in plan:
        entry = {"row": label, "batch": batch, "status": "running"}
        result["rows"].append(entry)
        if time.time() > deadline - SLACK_S:
            entry["status"] = "skipped: time budget"
            continue
        record(result)
        try:
            prog = program(args, ctx, graphs, **changes)
            ids = models.prompt(
                batch, pair["target"].config.vocab_size, args.prompt_len, pair["target"].device
            )
            entry.update(rows.measure(prog, ids, args, label, part))
        except ConfigError as exc:  # cuda_graphs=True off CUDA
            entry["status"] = f"skipped: {exc}"
        except Exception as exc:
            entry.update(rows.error_entry(label, exc))
        record(result)
        if entry["status"] == "ok" and "trace" not in result:
            try:
                result["trace"] = {"row": label} | trace.profile_rounds(
                    prog, ids, args.max_new_tokens, Path(args.out), name
                )
            except Exception as exc:
                result["trace"] = {
                    "row": label,
                    "file": None,
                    "status": f"error: {type(exc).__name__}: {str(exc)[:500]}",
                }
            record(result)
        if hang is not None and entry["status"] == "ok":  # testing: stall once a row has measured
            hang()
            hang = None
    result["capture_s"] = ctx.get("capture_s")
    if any(
        r["status"] != "ok" and not r["status"].startswith("skipped: cuda_graphs") for r in result["rows"]
    ):
        result["status"] = "partial: some rows skipped or failed (see rows)"
    return result


def part_a(args, ctx, record, deadline, hang) -> dict:
    """AR first (the figure the issue asks for; then with the one-query attention as Inductor's own reductions
    instead of SDPA, ``attention="reduce"``: on the H200 cuDNN's kernel took 12 us a layer), then the micro-benchmarks with the time left (at most
    ``MICRO_S``; on a warm machine the AR compiles come from the cache and leave them time)."""
    result = _start(args, ctx, record)
    result = speed_rows(
        "A",
        args,
        ctx,
        result,
        record,
        deadline,
        [
            ("ar_graphs_off", False, 1, {"mode": "ar"}),
            ("ar_graphs_on", True, 1, {"mode": "ar"}),
            ("ar_graphs_on_attention_reduce", True, 1, {"mode": "ar", "attention": "reduce"}),
        ],
        hang,
    )
    result["micro"] = hardware.micro(
        args, models.SHAPES[args.scale], args.k + 1, min(deadline - SLACK_S, time.time() + MICRO_S)
    )
    return result


def part_b(args, ctx, record, deadline, hang) -> dict:
    """SD with graphs on first (what a user gets), then off; AR last, when time is left, for SD/AR in one run."""
    result = _start(args, ctx, record)
    return speed_rows(
        "B",
        args,
        ctx,
        result,
        record,
        deadline,
        [
            ("sd_graphs_on", True, 1, {"mode": "sd"}),
            ("sd_graphs_off", False, 1, {"mode": "sd"}),
            ("ar_graphs_on", True, 1, {"mode": "ar"}),
        ],
        hang,
    )


def part_c(args, ctx, record, deadline, hang) -> dict:
    from . import overlap

    result = _start(args, ctx, record)
    result = speed_rows(
        "C",
        args,
        ctx,
        result,
        record,
        deadline,
        [
            ("ssd", args.cuda_graphs, 1, {"mode": "ssd", "sd_when_faster": False}),
            ("ssd_planner", args.cuda_graphs, 1, {"mode": "ssd"}),
        ],
        hang,
    )
    if result["rows"][0]["status"] != "ok":
        result["overlap"] = {"status": "skipped: the ssd row did not run"}
    elif time.time() > deadline - SLACK_S:
        result["overlap"] = {"status": "skipped: time budget"}
    else:
        ssd = program(args, ctx, args.cuda_graphs, mode="ssd", sd_when_faster=False)
        pair = ctx["pair"]
        ids = models.prompt(1, pair["target"].config.vocab_size, args.prompt_len, pair["target"].device)
        try:
            result["overlap"] = {"status": "ok"} | overlap.measure(ssd, ids, args)
        except Exception as exc:
            result["overlap"] = {"status": f"error: {type(exc).__name__}: {str(exc)[:500]}"}
    return result


def part_d(args, ctx, record, deadline, hang) -> dict:
    from . import exactness

    result = {"environment": hardware.environment(args), "subphases": {}}
    subs = args.exactness.split(",")
    for sub in subs:
        result["subphases"][sub] = {"status": "pending"}
    record(result)
    if hang is not None:
        hang()
    for i, sub in enumerate(subs):
        node = result["subphases"][sub]
        if sub in exactness.CUDA_ONLY and not args.device.startswith("cuda"):
            node["status"] = "skipped: cuda_graphs needs CUDA"
            continue
        # each later sub-phase keeps a minute
        own = deadline - 60.0 * sum(
            1 for s in subs[i + 1 :] if s not in exactness.CUDA_ONLY or args.device != "cpu"
        )
        if time.time() > own - SLACK_S:
            node["status"] = "skipped: time budget"
            continue
        node["status"] = "running"
        started = time.time()

        def sub_record(data, node=node):
            node.update(data)
            record(result)

        try:
            node.update(exactness.run(sub, args, sub_record, own))
            node.setdefault("status", "ok")
            if node["status"] == "running":
                node["status"] = "ok"
        except Exception as exc:
            node.update({"status": f"error: {type(exc).__name__}: {str(exc)[:500]}"})
        node["seconds"] = round(time.time() - started, 2)
        record(result)
    statuses = [n["status"] for n in result["subphases"].values()]
    if any(s.startswith(("error", "false")) for s in statuses):
        result["status"] = "false or failed: see subphases"
    elif any(s.startswith(("partial", "skipped: time")) for s in statuses):
        result["status"] = "partial: see subphases"
    return result


def part_e(args, ctx, record, deadline, hang) -> dict:
    result = _start(args, ctx, record)
    graphs = args.cuda_graphs
    return speed_rows(
        "E",
        args,
        ctx,
        result,
        record,
        deadline,
        [
            ("ar", graphs, 8, {"mode": "ar"}),
            ("sd", graphs, 8, {"mode": "sd"}),
            ("ssd_planner", graphs, 8, {"mode": "ssd"}),
            ("ssd", graphs, 8, {"mode": "ssd", "sd_when_faster": False}),
        ],
        hang,
    )


PARTS = {"A": part_a, "B": part_b, "C": part_c, "D": part_d, "E": part_e}


def close(ctx: dict) -> None:
    """Stop the draft lanes of the part's programs."""
    for prog in ctx.get("programs", {}).values():
        prog.close()
