"""The few-row linears of a real-size target on the packed kernel, against the memory read bandwidth measured
in the same process: what the issue-57 journal's kernel table reports.

    python benchmarks/parts/roofline_linears.py --shape tinyllama-1.1b --rows 1,2,6 --json roofline_linears.json

Takes the linear shapes a decode step calls (per layer q/k/v joined, o, gate/up joined, down, then the head)
of a ``benchmarks/real_size/make_pair.py`` shape, fills them with random weights (the values do not change the
time) held as bfloat16 panels, int8 and int4 (``--kinds``), and times one pass over every linear for each row
count, the kinds and row counts alternating, ``--repeats`` passes each (medians). Each row: milliseconds a
pass, GB/s (panel and scale bytes over the time) and that over ``read_bandwidth()``, measured first. The panels
are held on huge pages, as the program holds them; ``--pages huge,torch`` adds each kind held in torch's
allocator (the comparison of ``docs/measurements/2026-12-06-huge-pages.md``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "real_size"))


def step_shapes(config) -> list[tuple[int, int]]:
    """``(N, K)`` of the linears one decode step calls, joined as pack_linears joins them."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    qkv = (config.num_attention_heads + 2 * config.num_key_value_heads) * head_dim
    layer = [
        (qkv, hidden),
        (hidden, config.num_attention_heads * head_dim),
        (2 * inter, hidden),
        (hidden, inter),
    ]
    return layer * config.num_hidden_layers + [(config.vocab_size, hidden)]


def held(kind: str, shapes, group: int, pages: str):
    """Every linear's panels (and scales) of ``kind``, on huge pages (``pages="huge"``, as the program holds
    them) or in torch's allocator (``"torch"``)."""
    from saguaro.tensor_math import huge_pages
    from saguaro.tensor_math import packed_linear as pl
    from saguaro.tensor_math import quantized_linear as ql

    place = huge_pages.on_huge_pages if pages == "huge" else (lambda t: t)
    out = []
    for n, k in shapes:
        weight = torch.randn(n, k, device="cpu")
        if kind == "bf16":
            out.append((place(pl.pack(weight.bfloat16())), None))
        else:
            bits = 8 if kind == "int8" else 4
            packed = ql.pack_quantized(*ql.quantize(weight, bits, None if bits == 8 else group), bits)
            out.append(tuple(place(t) for t in packed))
    return out


def one_pass(weights, xs, shapes) -> float:
    ops = torch.ops.saguaro_kernels
    start = time.perf_counter()
    for x, (panels, scales), (n, _) in zip(xs, weights, shapes):
        ops.packed_linear(x, panels, n) if scales is None else ops.packed_linear_q(x, panels, scales, n)
    return time.perf_counter() - start


def main(argv=None) -> None:
    import make_pair

    from saguaro.tensor_math.packed_linear import available, read_bandwidth, unavailable_reason

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="tinyllama-1.1b", help=f"one of {', '.join(make_pair.SHAPES)}")
    p.add_argument("--rows", default="1,2,6", help="comma-separated row counts (default 1,2,6)")
    p.add_argument("--kinds", default="bf16,int8,int4", help="weight forms (default bf16,int8,int4)")
    p.add_argument("--group", type=int, default=64, help="k per int4 scale (default 64)")
    p.add_argument(
        "--pages",
        default="huge",
        help="where the panels are held: huge (2 MiB pages where the "
        "platform allows, as the program holds them), torch (its allocator, 4 KiB pages unless "
        "THP_MEM_ALLOC_ENABLE=1), or huge,torch for both, alternating (default huge)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    if not set(args.pages.split(",")) <= {"huge", "torch"}:
        raise SystemExit(f"--pages {args.pages!r}: give huge, torch or huge,torch")
    if args.threads:
        torch.set_num_threads(args.threads)
    if not available():
        raise SystemExit(f"the packed kernel could not be built: {unavailable_reason()}")
    shapes = step_shapes(make_pair.make_config(args.shape))
    read_gbs = read_bandwidth()
    rows = [int(r) for r in args.rows.split(",")]
    kinds = {
        kind if pages == "huge" else f"{kind}/{pages}": held(kind, shapes, args.group, pages)
        for kind in args.kinds.split(",")
        for pages in args.pages.split(",")
    }
    inputs = {m: [torch.randn(m, k, device="cpu") for _, k in shapes] for m in rows}
    times: dict = {(kind, m): [] for kind in kinds for m in rows}
    for _kind, weights in kinds.items():
        for m in rows:
            one_pass(weights, inputs[m], shapes)  # warm
    for _ in range(args.repeats):
        for kind, weights in kinds.items():
            for m in rows:
                times[kind, m].append(one_pass(weights, inputs[m], shapes))
    report = []
    print(
        f"read bandwidth {read_gbs:.1f} GB/s on {torch.get_num_threads()} threads; {args.shape}, "
        f"{len(shapes)} linears a step"
    )
    print(f"{'weights':<12}{'rows':>6}{'ms':>10}{'GB/s':>8}{'share':>8}{'vs 1 row':>10}")
    for kind, weights in kinds.items():
        size = sum(w.numel() * w.element_size() + (0 if s is None else s.numel() * 4) for w, s in weights)
        one = statistics.median(times[kind, rows[0]])
        for m in rows:
            seconds = statistics.median(times[kind, m])
            report.append(
                {
                    "weights": kind,
                    "rows": m,
                    "ms": 1e3 * seconds,
                    "gbs": size / seconds / 1e9,
                    "share": size / seconds / 1e9 / read_gbs,
                    "vs_first_rows": seconds / one,
                }
            )
            r = report[-1]
            print(
                f"{kind:<12}{m:>6}{r['ms']:>10.1f}{r['gbs']:>8.1f}{r['share']:>8.2f}{r['vs_first_rows']:>9.2f}x"
            )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "shape": args.shape,
                    "read_gbs": read_gbs,
                    "threads": torch.get_num_threads(),
                    "rows": report,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
