"""How fast this CPU's matmul paths read a model's weights: the floor under a decode step.

    python benchmarks/matmul_rates.py --threads 1 --rows 1,6 --json matmul_rates.json

Takes the weight matrices of the default pair's target (or ``--target DIR``: any Llama-like Hugging Face
folder), every linear layer's and the LM head's, and times one pass over all of them for ``M`` rows of
activations (``M=1``: an AR step, ``M=k+1``: SD's verify), by each path torch offers on a CPU:

- ``linear``: ``torch.nn.functional.linear(x, W)`` with ``W [N, K]`` as stored (what eager and Inductor's
  ``mm`` / ``addmm`` calls run: MKL here);
- ``transposed``: ``x @ Wt`` with ``Wt [K, N]`` contiguous, the weight transposed once beforehand;
- ``onednn``: oneDNN's linear over a weight reordered for ``M`` rows (``mkldnn._reorder_linear_weight``,
  what Inductor's freezing packs weights into);
- ``mul_sum``: ``(x[:, None, :] * W).sum(-1)``, the weight read by an elementwise kernel and a reduction;
- ``inductor_sum``: the same product and sum compiled by Inductor (C++ wrapper), which fuses them into one
  vectorised reduction that reads each weight once (compiled before timing; ``--no-inductor`` skips it).

Prints milliseconds per pass, the weight bytes read per second and the tokens/s ceiling that implies
for an AR step (``M=1``); writes JSON with ``--json``. Times are medians of ``--repeats`` blocks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def weight_matrices(target_dir: str | None) -> list[torch.Tensor]:
    """Every 2-D weight a decode step multiplies by: the linear layers' and the LM head's ``[N, K]``."""
    if target_dir is None:
        import saguaro

        model = saguaro.default_pair()[0]
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    return [m.weight.detach().float().contiguous() for m in model.modules() if isinstance(m, torch.nn.Linear)]


def products_summed(inputs: dict, mats: list) -> list:
    """``x @ W.T`` for every weight as a product and a sum over K: ``[M, N]`` each."""
    return [(inputs[w.shape[1]][:, None, :] * w).sum(-1) for w in mats]


def paths(mats: list[torch.Tensor], rows: int, inductor: bool = True) -> dict:
    inputs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in mats}}  # [M, K]
    transposed = [w.t().contiguous() for w in mats]  # [K, N]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in mats]
    found = {
        "linear": lambda: [torch.nn.functional.linear(inputs[w.shape[1]], w) for w in mats],
        "transposed": lambda: [inputs[wt.shape[0]] @ wt for wt in transposed],
        "onednn": lambda: [torch.ops.mkldnn._linear_pointwise(inputs[w.shape[1]], p, None, "none", [], "")
                           for w, p in zip(mats, packed)],
        "mul_sum": lambda: products_summed(inputs, mats),
    }
    if inductor:
        compiled = torch.compile(products_summed, fullgraph=True, options={"cpp_wrapper": True})
        compiled(inputs, mats)  # compile before the clock
        found["inductor_sum"] = lambda: compiled(inputs, mats)
    return found


def median_seconds(fn, repeats: int, per_block: int) -> float:
    for _ in range(per_block):
        fn()
    blocks = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(per_block):
            fn()
        blocks.append((time.perf_counter() - start) / per_block)
    return statistics.median(blocks)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", metavar="DIR", help="a Hugging Face model folder (default: the default pair's target)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--rows", default="1,6", help="comma-separated activation rows M (default 1,6)")
    p.add_argument("--repeats", type=int, default=7, help="timed blocks per path (default 7)")
    p.add_argument("--no-inductor", action="store_true", help="skip the path Inductor compiles")
    p.add_argument("--json", metavar="PATH", help="write the results here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    mats = weight_matrices(args.target)
    megabytes = sum(w.numel() * w.element_size() for w in mats) / 1e6
    print(f"{len(mats)} weight matrices, {megabytes:.1f} MB, {torch.get_num_threads()} threads")
    results = []
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            for name, fn in paths(mats, rows, not args.no_inductor).items():
                seconds = median_seconds(fn, args.repeats, per_block=20)
                results.append({"rows": rows, "path": name, "ms": 1000 * seconds,
                                "gb_per_s": megabytes / 1000 / seconds,
                                "ar_ceiling_tokens_per_s": 1 / seconds if rows == 1 else None})
                ceiling = f"   AR ceiling {1 / seconds:6.0f} tokens/s" if rows == 1 else ""
                rate = megabytes / 1000 / seconds
                print(f"M={rows:<3} {name:<13} {1000 * seconds:7.2f} ms  {rate:5.1f} GB/s{ceiling}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "megabytes": megabytes, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
