"""The GPU probe's phases (``gpu_probe.py``): each is ``fn(name, args, ctx, record, deadline) -> dict``.

``record(dict)`` writes a phase's results so far into the report at once (a run cut short keeps them);
``deadline`` (``time.time()`` seconds) is when the phase's unit should be done: long phases skip their
remaining checks past it and say so. ``ctx`` carries objects from one phase to the next in one process
(the speed phase's program, which the overlap phase reuses). Also: the environment phase.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import subprocess
import sys


def available_options() -> dict:
    """Which options of the GPU-readiness work this build has (other helpers add some of them)."""
    from saguaro.core import config

    fields = {f.name for f in dataclasses.fields(config.SaguaroConfig)}
    return {"cuda_graphs": "cuda_graphs" in fields, "draft_device": "draft_device" in fields,
            "attention_flex": "flex" in getattr(config, "ATTENTIONS", ())}


def environment(name, args, ctx, record, deadline) -> dict:
    import torch
    import transformers

    info = {
        "python": sys.version.split()[0], "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "transformers": transformers.__version__,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "torch_threads": torch.get_num_threads(), "saguaro_git": _git_revision(),
        "saguaro_config_fields": [f.name for f in dataclasses.fields(_config_class())],
        "options": available_options(), "cuda_available": torch.cuda.is_available(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        device = torch.device(args.device if args.device.startswith("cuda") else "cuda")
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = {
            "name": props.name, "compute_capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1), "multiprocessors": props.multi_processor_count,
            "device_count": torch.cuda.device_count(), "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
        }
        info["nvidia_smi"] = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,"
                                   "clocks.max.sm,power.limit", "--format=csv,noheader"])
    return info


def _config_class():
    from saguaro.core.config import SaguaroConfig

    return SaguaroConfig


def _git_revision() -> str | None:
    out = _run(["git", "-C", os.path.dirname(os.path.abspath(__file__)), "rev-parse", "--short", "HEAD"])
    dirty = _run(["git", "-C", os.path.dirname(os.path.abspath(__file__)), "status", "--porcelain"])
    return None if out is None else out + (" (with uncommitted changes)" if dirty else "")


def _run(cmd: list) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def exactness(name, args, ctx, record, deadline) -> dict:
    import probe_exactness

    return probe_exactness.run(name.partition(":")[2], args, record, deadline)


def speed(name, args, ctx, record, deadline) -> dict:
    import probe_speed

    return probe_speed.run(args, ctx, record, deadline)


def overlap(name, args, ctx, record, deadline) -> dict:
    import probe_overlap

    return probe_overlap.run(args, ctx, record, deadline)


PHASES = {"environment": environment, "exactness": exactness, "speed": speed, "overlap": overlap}
