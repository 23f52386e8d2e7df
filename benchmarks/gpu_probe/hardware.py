"""Part A's measurements of the machine: the environment, the copy bandwidth, and two micro-benchmarks
for the next GPU session's defaults.

- ``bandwidth``: a device-to-device copy of a buffer far past the L2 (2 GiB on CUDA; 64 MiB on a CPU,
  a memcpy-like ``copy_``), timed with CUDA events (host clock on CPU), bytes read plus written over
  the median time. Every speed part measures it again (a second) for its ``roofline_share``.
- ``micro``: the verify's few-row linears (M = k+1 rows) at the model's widths, as cuBLAS (``F.linear``),
  as Inductor's fused reduction (``linears="reduction"``'s form: a product and a sum) and the same with
  ``coordinate_descent_tuning``; and one decode step's attention at a 2,048-token context in a KV
  store of twice that capacity: SDPA under a dense mask over the whole capacity, SDPA over the valid
  slots alone, and FlexAttention under a block mask. Compiled variants run on CUDA only (on a small CPU
  Inductor's C++ compile of each takes tens of seconds); each row says so.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def environment(args) -> dict:
    import torch
    import transformers

    from saguaro.core.config import SaguaroConfig

    info = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "commit": args.commit or git_revision(),
        "cuda_available": torch.cuda.is_available(),
        "saguaro_config_fields": [f.name for f in dataclasses.fields(SaguaroConfig)],
        "inductor_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available() and args.device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(args.device))
        info["gpu"] = {
            "name": props.name,
            "compute_capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count,
        }
        info["nvidia_smi"] = _run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit",
                "--format=csv,noheader",
            ]
        )
    return info


def git_revision() -> str | None:
    """This checkout's commit; None where the copy has no ``.git`` of its own (a parent folder's repository
    would answer for another project: pass ``--commit``)."""
    if not (REPO / ".git").exists():
        return None
    out = _run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])
    dirty = _run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"])
    return None if out is None else out + (" (with uncommitted changes)" if dirty else "")


def _run(cmd: list) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def timer(device):
    """``fn -> seconds`` of one call: CUDA events on CUDA, the host clock elsewhere."""
    import torch

    if device.type == "cuda":

        def timed(fn) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000

        return timed

    def host(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return host


def median_s(fn, device, repeats: int, warmup: int = 3) -> float:
    timed = timer(device)
    for _ in range(warmup):
        timed(fn)
    return statistics.median(timed(fn) for _ in range(repeats))


def bandwidth(device) -> dict:
    """Copy bandwidth: bytes read plus written over the median time of ``dst.copy_(src)``."""
    import torch

    size = 2 * 2**30 if device.type == "cuda" else 64 * 2**20
    src = torch.empty(size // 4, dtype=torch.float32, device=device).uniform_()  # not zeros
    dst = torch.empty_like(src)
    seconds = median_s(lambda: dst.copy_(src), device, repeats=10 if device.type == "cuda" else 5)  # noqa: F821 (del below)
    moved = 2 * size
    del src, dst
    return {
        "bytes_per_s": moved / seconds,
        "gb_per_s": round(moved / seconds / 1e9, 2),
        "buffer_bytes": size,
        "how": f"{'device-to-device' if device.type == 'cuda' else 'host memory'} copy of {size / 2**20:.0f} MiB, "
        "read + write over the median of the timed copies",
    }


def micro(args, shape: dict, rows: int, deadline: float) -> dict:
    """The linear-choice and decode-attention rows (see the module's docstring)."""
    import torch

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    out = {"rows": [], "m_rows": rows, "dtype": str(dtype).removeprefix("torch.")}
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * h // shape["num_attention_heads"]
    for name, (k_in, n_out) in {
        "q_proj": (h, h),
        "k_proj": (h, kv),
        "gate_proj": (h, inter),
        "down_proj": (inter, h),
        "lm_head": (h, shape["vocab_size"]),
    }.items():
        if cuda:  # both compiled variants share one function's code: dynamo's recompile limit counts them all
            torch._dynamo.reset()
        x = torch.randn(rows, k_in, device=device, dtype=dtype)
        w = torch.randn(n_out, k_in, device=device, dtype=dtype) / k_in**0.5
        for variant, fn in linear_variants(cuda):
            row = {"what": f"linear {name} [{rows}x{k_in}] @ [{k_in}x{n_out}]", "variant": variant}
            out["rows"].append(row)
            if fn is None:
                row["status"] = (
                    "skipped: CUDA only (Inductor's compile of it takes tens of seconds on a small CPU)"
                )
                continue
            if time.time() > deadline:
                row["status"] = "skipped: time budget"
                continue
            row |= _time(lambda f=fn: f(x, w), device)  # noqa: B023 (timed now)
    out["rows"] += attention_rows(shape, device, dtype, cuda, deadline)
    return out


def linear_variants(cuda: bool) -> list:
    import torch
    import torch.nn.functional as F

    def reduction(x, w):  # linears="reduction": W[N, 1, K] * x[1, M, K], summed over K
        return (w.unsqueeze(1) * x.unsqueeze(0)).sum(-1).t()  # [M, N]

    compiled = compiled_tuned = None
    if cuda:
        compiled = torch.compile(reduction, dynamic=False)

        compiled_tuned = torch.compile(reduction, dynamic=False, options={"coordinate_descent_tuning": True})

    return [
        ("cublas F.linear" if cuda else "aten F.linear", F.linear),
        ("inductor reduction", compiled),
        ("inductor reduction + coordinate_descent_tuning", compiled_tuned),
    ]


def _time(fn, device) -> dict:
    try:
        first = time.perf_counter()
        fn()
        first_s = time.perf_counter() - first
        return {
            "status": "ok",
            "us": round(1e6 * median_s(fn, device, repeats=50 if device.type == "cuda" else 5), 2),
            "first_call_s": round(first_s, 2),
        }
    except Exception as exc:
        return {"status": f"error: {type(exc).__name__}: {str(exc)[:300]}"}


def attention_rows(shape: dict, device, dtype, cuda: bool, deadline: float, context: int = 2048) -> list:
    """One query token against ``context`` valid slots of a store of ``2 * context`` slots."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    head_dim = shape["hidden_size"] // heads
    context = context if cuda else 256
    capacity = 2 * context
    q = torch.randn(1, heads, 1, head_dim, device=device, dtype=dtype)  # [B, H, 1, D]
    k = torch.randn(1, kv_heads, capacity, head_dim, device=device, dtype=dtype)  # [B, Hkv, S, D]
    v = torch.randn_like(k)
    dense = torch.full((1, 1, 1, capacity), float("-inf"), device=device, dtype=dtype)  # [B, 1, 1, S]
    dense[..., :context] = 0
    what = f"decode attention, 1 query, {context} of {capacity} slots, {heads} heads ({kv_heads} KV) x {head_dim}"
    if cuda:
        torch._dynamo.reset()
    sdpa = F.scaled_dot_product_attention
    variants = {
        "sdpa dense mask over the capacity": lambda: sdpa(q, k, v, attn_mask=dense, enable_gqa=True),
        "sdpa over the valid slots": lambda: sdpa(q, k[:, :, :context], v[:, :, :context], enable_gqa=True),
        "flex block mask": None,
    }
    if cuda:  # off CUDA flex is unfused (the whole score matrix) and compiles for seconds: not a finding
        block = create_block_mask(
            lambda b, h, q_idx, kv_idx: kv_idx < context, 1, None, 1, capacity, device=str(device)
        )
        flex = torch.compile(flex_attention, dynamic=False)
        variants["flex block mask"] = lambda: flex(q, k, v, block_mask=block, enable_gqa=True)
    rows = []
    for variant, fn in variants.items():
        row = {"what": what, "variant": variant}
        if fn is None:
            row["status"] = "skipped: CUDA only (unfused elsewhere)"
        rows.append(
            row | ({"status": "skipped: time budget"} if time.time() > deadline else _time(fn, device))
            if fn is not None
            else row
        )
    return rows
