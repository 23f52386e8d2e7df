"""Kernel choice: how a stage runs its attention and its linears, by backend, device and stage."""

from __future__ import annotations

# the stage families read here are stage-table data, kept in core; the choice is lowering's
from saguaro.core.stages import (
    DRAFT_CHAIN,
    DRAFT_STEP,
    DRAFT_TREE,
    FEW_ROW_FAMILIES,
    MULTI_ROW_FAMILIES,
    TARGET_PREFILL,
    TARGET_ROUND,
    TARGET_STEP,
    TARGET_VERIFY,
    TARGET_VERIFY_ROUND,
    Stage,
)

# attention="auto", the tree stage of Inductor on CUDA: FlexAttention over the tree's block mask instead of
# SDPA, off until benchmarks/gpu_probe.py shows flex exact and faster there. "flex" is opt-in elsewhere
# (Inductor on CPU does not compile it for one-token steps).
FLEX_TREE_ON_CUDA = False
# attention="auto" of Inductor on CPU, AR's target stages: Inductor's own reductions rather than SDPA; the
# draft's step keeps SDPA (docs/measurements/2026-12-03-ar-round.md)
REDUCED_ATTENTION = (TARGET_STEP, TARGET_ROUND)
# attention="auto" on CPU, where saguaro_kernels builds: SD's verify and the draft's step (chained too) on the
# masked_attention C++ kernel (docs/measurements/2026-12-05-sd-round-on-the-cpu.md); eager takes it too
# (docs/measurements/2026-12-05-serve-batch-in-place.md)
KERNEL_ATTENTION = (*TARGET_VERIFY, TARGET_VERIFY_ROUND, *DRAFT_STEP, DRAFT_CHAIN)


def attention_implementation(
    backend: str,
    requested: str = "auto",
    device_type: str = "cpu",
    mask: str | None = None,
    flex_tree: bool | None = None,
    stage: Stage | None = None,
    kernel_built: bool = False,
) -> str:
    """The form ``lower_attention`` gives the attention of ``stage`` (mask ``mask``; None: any stage).

    A ``requested`` form is kept, ``"reduce"`` for :data:`REDUCED_ATTENTION` only and ``"kernel"`` for
    :data:`KERNEL_ATTENTION` on a CPU only (``"inline"`` elsewhere). ``"auto"``: ``"kernel"`` for
    :data:`KERNEL_ATTENTION` on a CPU where ``kernel_built``; else eager ``"op"``, Inductor ``"flex"`` for
    the tree on CUDA when ``flex_tree`` (default :data:`FLEX_TREE_ON_CUDA`), ``"reduce"`` for
    :data:`REDUCED_ATTENTION` on a CPU, otherwise ``"inline"``."""
    if requested == "reduce":
        return "reduce" if stage in REDUCED_ATTENTION else "inline"
    if requested == "kernel":
        return "kernel" if stage in KERNEL_ATTENTION and device_type == "cpu" else "inline"
    if requested != "auto":
        return requested
    if backend != "inductor":
        return "kernel" if device_type == "cpu" and stage in KERNEL_ATTENTION and kernel_built else "op"
    flex_tree = FLEX_TREE_ON_CUDA if flex_tree is None else flex_tree
    if flex_tree and device_type == "cuda" and mask == DRAFT_TREE.greedy.mask:
        return "flex"
    if device_type == "cpu" and stage in REDUCED_ATTENTION:
        return "reduce"
    if device_type == "cpu" and stage in KERNEL_ATTENTION and kernel_built:
        return "kernel"
    return "inline"


def linear_implementation(
    backend: str, requested: str = "auto", device_type: str = "cpu", family: str | None = None
) -> str:
    """How a stage of ``family`` runs its linears: ``"packed"``, ``"reduction"``, ``"template"``, ``"gemm"``.

    The prefill: ``"packed"`` if requested, or for ``"auto"`` / ``"template"`` on Inductor/CPU; else
    ``"gemm"``, as for any family outside :data:`FEW_ROW_FAMILIES` or ``"gemm"`` requested. ``"template"``:
    on Inductor/CPU for :data:`MULTI_ROW_FAMILIES`, else as ``"auto"``. ``"reduction"`` / ``"packed"``: as
    requested. ``"auto"``: ``"packed"`` on Inductor/CPU, else ``"gemm"`` (CUDA: not measured). Measured:
    docs/measurements/2026-12-04-packed-few-row-kernel.md, docs/measurements/2026-12-06-packed-one-row.md."""
    on_cpu_inductor = backend == "inductor" and device_type == "cpu"
    if family == TARGET_PREFILL.family:  # T rows: the packed kernel or BLAS, never reductions
        if requested == "packed" or (requested in ("auto", "template") and on_cpu_inductor):
            return "packed"
        return "gemm"
    if requested == "gemm" or family not in FEW_ROW_FAMILIES:
        return "gemm"
    if requested == "template" and on_cpu_inductor and family in MULTI_ROW_FAMILIES:
        return "template"
    if requested in ("reduction", "packed"):
        return requested
    if on_cpu_inductor:
        return "packed"
    return "gemm"
