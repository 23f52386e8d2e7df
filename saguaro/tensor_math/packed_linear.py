"""A linear layer of few rows over a weight packed once, read in float32, float16, bfloat16, int8 or int4: the ops
``torch.ops.saguaro_kernels.packed_linear(x [M, K], packed [P, K, 64], n) -> [M, n]`` and
``torch.ops.saguaro_kernels.packed_linear_q(x [M, K], packed, scales [P, G, 64], n) -> [M, n]``.

A verify, glue or tree stage multiplies a handful of rows (``K+1``, ``MQ``) by every weight of the model, so
its time is the weights' bytes. The kernel (``packed_linear.cpp``) reads each weight from a panel layout
(:func:`pack`: 64 output columns a panel, ``[P, K, 64]``, made once per weight, so each thread streams its
panels front to back) in the dtype it is held in, widens it in registers, and sums each output over
``k = 0 .. K-1`` in order with fused multiply-adds in float32: the result does not depend on the storage dtype
(a float16-held weight gives the float32 weight's outputs bit for bit), the vector width (the scalar loop,
``packed_linear_scalar``, gives the same bits), the number of rows or the thread count. Quantized panels
(:mod:`~saguaro.tensor_math.quantized_linear`: int8, or int4 two to a byte, with a float32 scale per group of
``k`` and column) widen each weight to ``float(q) * scale`` before its multiply-add: the outputs are the
dequantized weight's bit for bit. Inductor calls the ops as extern kernels (from its C++ wrapper through
the dispatcher).

The C++ sources of the ``saguaro_kernels`` library (this kernel's and ``masked_attention.cpp``'s, see
:mod:`~saguaro.tensor_math.masked_attention`) are compiled at first use with the machine's instruction set
(``-march=native``) by
``torch.utils.cpp_extension`` into ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``), under a
name derived from the sources, the flags, torch's version and the CPU, so later processes load the library
(``torch.ops.load_library``) without compiling it or importing the builder.
:func:`available` says whether it could be built (no compiler: the caller keeps another implementation).
"""

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
    digest = hashlib.sha256("\n".join([*texts, " ".join(CFLAGS), torch.__version__, _cpu_signature()]).encode())
    return f"saguaro_packed_linear_{digest.hexdigest()[:16]}"


def available() -> bool:
    """Whether the op is registered: builds (or loads the cached build of) the extension the first time."""
    with _lock:
        if "loaded" not in _state:
            try:
                _load()
                _register_fakes()
                _state["loaded"] = True
            except Exception as exc:  # no compiler, no ninja: the callers keep their other linears
                _state.update(loaded=False, error=f"{type(exc).__name__}: {exc}")
                log.warning("packed_linear: the C++ kernel could not be built (%s); few-row stages keep "
                            "Inductor's reductions", _state["error"])
        return _state["loaded"]


def build_directory(name: str) -> Path:
    """Where the build named ``name`` lives: ``$TORCH_EXTENSIONS_DIR/name`` (default ``~/.cache/torch_extensions``)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / name


def _load() -> None:
    """Load the cached build (named by :func:`library_name`, so it is this source's), else build it."""
    name = library_name()
    folder = build_directory(name)
    built = folder / f"{name}.so"
    if built.exists() and not (folder / "lock").exists():  # built, no build running: no builder import, no ninja
        torch.ops.load_library(str(built))
        return
    from torch.utils.cpp_extension import load  # not load_inline: it prepends torch/extension.h (a minute of g++)

    folder.mkdir(parents=True, exist_ok=True)
    load(name=name, sources=[str(source) for source in SOURCES], extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"],
         is_python_module=False, verbose=False, build_directory=str(folder))


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
    """The machine's memory read bandwidth in GB/s, measured now: the best of ``passes`` reads of a ``megabytes``
    buffer (far past any last-level cache) by the kernel library's ``stream_read``, on torch's intra-op threads,
    split as the packed linears split their panels, on huge pages where the platform allows, as the panels are. What a few-row linear's weight stream is held against (its
    roofline share). Raises ``RuntimeError`` where the library could not be built."""
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
    """``weight [N, K]`` (any of float32, float16, bfloat16, int8) as panels ``[ceil(N/64), K, 64]`` of the same
    dtype: panel ``p`` holds rows ``64p .. 64p+63`` transposed, the rows past ``N`` zero."""
    n, k = weight.shape
    panels = -(-n // PANEL)
    with torch.no_grad():
        padded = torch.zeros(panels * PANEL, k, dtype=weight.dtype, device=weight.device)  # [P*16, K]
        padded[:n] = weight
        return padded.view(panels, PANEL, k).transpose(1, 2).contiguous()  # [P, K, 64]


def packed_linear_q(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """``x [M, K]`` float32 times the quantized weight ``(packed, scales)`` hold
    (:func:`~saguaro.tensor_math.quantized_linear.pack_quantized`), transposed: ``[M, n]`` float32, equal bit for
    bit to :func:`packed_linear` over the dequantized weight."""
    return torch.ops.saguaro_kernels.packed_linear_q(x, packed, scales, n)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """``x [M, K]`` float32 times the weight ``packed`` holds (:func:`pack`), transposed: ``[M, n]`` float32."""
    return torch.ops.saguaro_kernels.packed_linear(x, packed, n)

