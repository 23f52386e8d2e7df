"""How the linear layers of a stage run (``SaguaroConfig.linears``), by stage family, backend and device."""

from __future__ import annotations

from saguaro.core.stages import FEW_ROW_FAMILIES, MULTI_ROW_FAMILIES, TARGET_PREFILL


def linear_implementation(backend: str, requested: str = "auto", device_type: str = "cpu",
                          family: str | None = None) -> str:
    """How the linears of a stage of ``family`` run: ``"reduction"`` (``linear_as_reduction``), ``"packed"``
    (``pack_linears``: the few-row C++ kernel over packed, narrow-held weights) or ``"gemm"`` (BLAS).
    ``"reduction"`` / ``"packed"`` rewrite the few-row stages (:data:`FEW_ROW_FAMILIES`; ``"packed"`` the prefill
    too) on any backend; ``"auto"``,
    for Inductor on CPU: packed for every few-row stage (the several-row ones, :data:`MULTI_ROW_FAMILIES`, 1.2-1.5x
    the narrow reductions at 6-32 rows, ``benchmarks/parts/few_row_linear.py``; the one-row ones since the kernel
    runs one row over several panels at once: AR 1.13x, SD 1.20x in whole generations, ``benchmarks/README.md``),
    the reductions where the kernel cannot be built (``saguaro.compile``); the prefill too (its ``T`` rows, a
    prompt's bucket: the kernel 2.7x MKL's GEMM at 16 rows, which streams and re-packs the float32 weights at each
    call, 1.2x at 128 and 256, even at 1,024; ``few_row_linear.py``), packed also on ``"packed"``, BLAS otherwise.
    ``"template"``: for Inductor on CPU, the several-row stages on Inductor's C++ GEMM template
    (:data:`~saguaro.lower.lowering.TEMPLATE_GEMM_CONFIG`), the others as ``"auto"``. Never chosen for CUDA by
    ``"auto"``: not measured there."""
    on_cpu_inductor = backend == "inductor" and device_type == "cpu"
    if family == TARGET_PREFILL.family:  # T rows: the packed kernel or BLAS, never reductions
        return "packed" if requested == "packed" or (requested in ("auto", "template") and on_cpu_inductor) else "gemm"
    if requested == "gemm" or family not in FEW_ROW_FAMILIES:
        return "gemm"
    if requested == "template" and on_cpu_inductor and family in MULTI_ROW_FAMILIES:
        return "template"
    if requested in ("reduction", "packed"):
        return requested
    if on_cpu_inductor:
        return "packed"
    return "gemm"
