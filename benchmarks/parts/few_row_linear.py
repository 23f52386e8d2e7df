"""The few-row linears of a verify / glue / tree stage, by each way Saguaro can run them on a CPU.

    python benchmarks/parts/few_row_linear.py --rows 1,6,12,32 --threads 2 --json few_row_linear.json

Takes the default pair's target's weight matrices (every linear layer's and the LM head's; ``--draft``: the
draft's) and times one pass over all of them for ``M`` rows, each path compiled by Inductor (C++ wrapper,
as a stage is) as one graph of all the linears:

- ``reduction_narrow``: ``linear_as_reduction``'s product and sum over weights held in float16 and widened
  in the kernel (``narrow_weights``): today's default for every few-row stage;
- ``reduction_f32``: the same over float32 weights;
- ``packed_narrow``: the packed few-row kernel (``saguaro/tensor_math/packed_linear.cpp``) over float16
  panels, widened in registers; ``packed_f32``: the same kernel over float32 panels (the same bits out);
- ``mkl``: ``aten.linear`` (MKL's GEMM) over float32 weights.

Passes alternate between the paths (one pass of each, ``--repeats`` times), so a loaded machine slows each
alike; the table gives median milliseconds a pass and each path's median per-round ratio to
``reduction_narrow``. Writes JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def weights(draft: bool) -> list[torch.Tensor]:
    import saguaro

    model = saguaro.default_pair()[1 if draft else 0]
    return [m.weight.detach().float().contiguous() for m in model.modules() if isinstance(m, torch.nn.Linear)]


def as_reduction(x, w):
    return (w[:, None, :] * x[None, :, :]).sum(-1).t().contiguous()  # [M, N]


def make_paths(mats: list[torch.Tensor], rows: int) -> dict:
    from saguaro.tensor_math import packed_linear as pl

    if not pl.available():
        raise SystemExit(f"the packed kernel could not be built: {pl.unavailable_reason()}")
    halves = [w.half() for w in mats]
    packed = {"packed_narrow": [pl.pack(h) for h in halves], "packed_f32": [pl.pack(w) for w in mats]}
    ns = [w.shape[0] for w in mats]

    def reduction(ws, narrow):
        def f(*xs):
            return [as_reduction(x, w.float() if narrow else w) for x, w in zip(xs, ws)]

        return f

    def kernel(ps):
        def f(*xs):
            return [torch.ops.saguaro_kernels.packed_linear(x, p, n) for x, p, n in zip(xs, ps, ns)]

        return f

    def mkl(*xs):
        return [torch.nn.functional.linear(x, w) for x, w in zip(xs, mats)]

    found = {
        "reduction_narrow": reduction(halves, True),
        "reduction_f32": reduction(mats, False),
        "packed_narrow": kernel(packed["packed_narrow"]),
        "packed_f32": kernel(packed["packed_f32"]),
        "mkl": mkl,
    }
    options = {"cpp_wrapper": True, "size_asserts": False, "memory_planning": True}
    return {name: torch.compile(fn, fullgraph=True, options=options) for name, fn in found.items()}


def time_rows(mats, rows: int, repeats: int, calls: int) -> dict:
    paths = make_paths(mats, rows)
    xs = [torch.randn(rows, w.shape[1]) for w in mats]  # [M, K] each
    outs = {name: fn(*xs) for name, fn in paths.items()}  # compiles
    same = all(torch.equal(a, b) for a, b in zip(outs["packed_narrow"], outs["packed_f32"]))
    times: dict = {name: [] for name in paths}
    for _ in range(repeats):
        for name, fn in paths.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn(*xs)
            times[name].append((time.perf_counter() - start) / calls * 1e3)
    base = times["reduction_narrow"]
    return {
        "rows": rows,
        "packed_bit_equal": same,
        "ms": {n: statistics.median(t) for n, t in times.items()},
        "ratio_to_reduction_narrow": {
            n: statistics.median(b / a for a, b in zip(t, base)) for n, t in times.items()
        },
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,6,12,32", help="comma-separated row counts M")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as torch starts)")
    parser.add_argument("--repeats", type=int, default=15, help="alternating rounds")
    parser.add_argument("--calls", type=int, default=20, help="passes a timed block")
    parser.add_argument("--draft", action="store_true", help="the draft's weights instead of the target's")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    mats = weights(args.draft)
    results = [time_rows(mats, int(r), args.repeats, args.calls) for r in args.rows.split(",")]
    names = list(results[0]["ms"])
    print(f"{'M':>3} " + " ".join(f"{n:>22}" for n in names) + "  (ms a pass; x speed of reduction_narrow)")
    for r in results:
        print(
            f"{r['rows']:>3} "
            + " ".join(f"{r['ms'][n]:>12.3f} ({r['ratio_to_reduction_narrow'][n]:>5.2f}x)" for n in names)
            + ("" if r["packed_bit_equal"] else "  NOT EQUAL")
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "threads": torch.get_num_threads(),
                    "weights": "draft" if args.draft else "target",
                    "results": results,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
