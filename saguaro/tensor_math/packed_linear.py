"""A few-row linear over a weight packed once in panels (:func:`pack`), summed over ``k`` in order in
float32: the same bits whatever the storage dtype, vector width, rows or threads (quantized: dequantized's).
The ``saguaro_kernels`` library is built at first use for this CPU and cached; see :func:`available`."""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path

import torch

from saguaro.tensor_math import huge_pages

log = logging.getLogger(__name__)

PANEL = 64  # output columns a panel holds (NB in the C++ source)
SOURCES = tuple(Path(__file__).with_name(name) for name in ("packed_linear.cpp", "masked_attention.cpp"))
# included by the sources: part of the build's name
HEADERS = tuple(Path(__file__).with_name(name) for name in ("stable_tensors.h", "packed_weights.h"))
CFLAGS = ("-O3", "-march=native", "-fopenmp")
_lock = threading.Lock()
_state: dict = {}  # "loaded": True / False once tried; "error": why not


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = next((line for line in text.splitlines() if line.startswith("flags")), "")
        model = next((line for line in text.splitlines() if line.startswith("model name")), "")
    except OSError:
        flags = model = ""
    return f"{platform.machine()} {model} {flags}"


def library_name() -> str:
    """The extension's name: one per sources, flags, torch version and CPU (so a cached build always fits)."""
    texts = [source.read_text() for source in SOURCES + HEADERS]
    digest = hashlib.sha256(
        "\n".join([*texts, " ".join(CFLAGS), torch.__version__, _cpu_signature()]).encode()
    )
    return f"saguaro_packed_linear_{digest.hexdigest()[:16]}"


def available() -> bool:
    """Whether the ops are registered: builds (or loads the cached build of) the library the first time."""
    with _lock:
        if "loaded" not in _state:
            try:
                _load()
                _register_fakes()
                _state["loaded"] = True
            except Exception as exc:  # no compiler, no ninja: the callers keep their other linears
                _state.update(loaded=False, error=f"{type(exc).__name__}: {exc}")
                log.warning(
                    "packed_linear: the C++ kernel could not be built (%s); few-row stages keep "
                    "Inductor's reductions",
                    _state["error"],
                )
        return _state["loaded"]


def build_directory(name: str) -> Path:
    """``$TORCH_EXTENSIONS_DIR/name`` (default ``~/.cache/torch_extensions/name``): where a build lives."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / name


def _load() -> None:
    name = library_name()
    folder = build_directory(name)
    built = folder / f"{name}.so"
    if (
        built.exists() and not (folder / "lock").exists()
    ):  # built, no build running: no builder import, no ninja
        torch.ops.load_library(str(built))
        return
    # not load_inline: it prepends torch/extension.h, slow to compile
    from torch.utils.cpp_extension import load

    folder.mkdir(parents=True, exist_ok=True)
    load(
        name=name,
        sources=[str(source) for source in SOURCES],
        extra_cflags=list(CFLAGS),
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
        build_directory=str(folder),
    )


def unavailable_reason() -> str | None:
    return _state.get("error")


def _register_fakes() -> None:
    for name in ("packed_linear", "packed_linear_scalar"):
        torch.library.register_fake(f"saguaro_kernels::{name}")(_fake)
    for name in ("packed_linear_q", "packed_linear_q_scalar"):
        torch.library.register_fake(f"saguaro_kernels::{name}")(_fake_quantized)
    torch.library.register_fake("saguaro_kernels::masked_attention")(_fake_attention)


def _fake(x, packed, n):
    return x.new_empty((x.shape[0], n))  # [M, n]


def _fake_quantized(x, packed, scales, n):
    return x.new_empty((x.shape[0], n))  # [M, n]


def _fake_attention(q, k, v, bias, scale):
    return q.new_empty(q.shape)  # [B, G, R, D]


def vectorised() -> bool:
    """Whether the build runs the vector path (AVX2, FMA, F16C), not the scalar loop."""
    return available() and bool(torch.ops.saguaro_kernels.vectorised())


def read_bandwidth(megabytes: int = 1024, passes: int = 3) -> float:
    """Memory read bandwidth in GB/s now, streamed as the panels are (``RuntimeError`` if not available)."""
    import time

    if not available():
        raise RuntimeError(f"read_bandwidth needs the kernel library: {unavailable_reason()}")
    buffer = huge_pages.empty((megabytes * 2**20 // 8,), torch.float64).fill_(1.0)  # touched: pages mapped
    torch.ops.saguaro_kernels.stream_read(buffer)
    best = float("inf")
    for _ in range(passes):
        started = time.perf_counter()
        torch.ops.saguaro_kernels.stream_read(buffer)
        best = min(best, time.perf_counter() - started)
    return buffer.numel() * 8 / best / 1e9


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` as panels ``[ceil(N/PANEL), K, PANEL]`` of its dtype, transposed, past ``N`` zero."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    with torch.no_grad():
        padded = torch.zeros(panels * PANEL, k, dtype=weight.dtype, device=weight.device)  # [P*64, K]
        padded[:n] = weight
        return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()  # [P, K, 64]


def packed_linear_q(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`packed_linear` over a ``pack_quantized`` weight, bit for bit as over the dequantized weight."""
    return torch.ops.saguaro_kernels.packed_linear_q(x, packed, scales, n)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """``x [M, K]`` float32 times the weight :func:`pack` packed, transposed: ``[M, n]`` float32."""
    return torch.ops.saguaro_kernels.packed_linear(x, packed, n)
