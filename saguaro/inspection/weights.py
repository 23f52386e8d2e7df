"""The weights a Program holds, each tensor counted once (by storage) in the form it is held (float32 as
loaded, a narrow copy, packed panels), with the stages that read it.

Held: referenced by a model's captured graph (the model's own tensors, shared) or by a stage built so far
(narrow copies, panels); a packed stage holds no float32 weight it no longer reads.
"""

from __future__ import annotations

import torch

from saguaro.passes.narrow_weights import ATTRIBUTE_PREFIX as NARROW_PREFIX
from saguaro.passes.pack_linears import ATTRIBUTE_PREFIX as PANEL_PREFIX


def _form(name: str) -> str:
    if PANEL_PREFIX in name:
        return "panels"
    return "narrow" if NARROW_PREFIX in name else "as loaded"


def _tensors(gm: torch.nn.Module):
    seen = set()
    for name, tensor in [
        *gm.named_parameters(remove_duplicate=False),
        *gm.named_buffers(remove_duplicate=False),
    ]:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield name, tensor


def program_weights(program) -> dict:
    """``{"total_bytes", "by_form": {form: bytes}, "by_dtype": {dtype: bytes}, "models": {model: {"bytes",
    "by_form", "stages": {stage: bytes it reads}}}}``: every tensor the program holds counted once (forms:
    ``as loaded``, ``narrow``, ``panels``; stages: those built so far)."""
    storages: dict = {}  # storage pointer -> (bytes, form, dtype, model)
    models: dict = {}
    for model in ("target", "draft"):
        runner = program.runner(model)
        if runner is None:
            continue
        entry = models[model] = {"bytes": 0, "by_form": {}, "stages": {}}
        sources = [("captured", runner.captured.graph_module)]
        sources += [(stage.qualified, gm) for stage, gm in runner.stage_graphs()]
        for label, gm in sources:
            read = 0
            for name, tensor in _tensors(gm):
                size = tensor.untyped_storage().nbytes()
                read += tensor.numel() * tensor.element_size()
                key = tensor.untyped_storage().data_ptr()
                if key not in storages:
                    storages[key] = (size, _form(name), str(tensor.dtype).replace("torch.", ""), model)
            if label != "captured":
                entry["stages"][label] = max(read, entry["stages"].get(label, 0))
    by_form: dict = {}
    by_dtype: dict = {}
    for size, form, dtype, model in storages.values():
        by_form[form] = by_form.get(form, 0) + size
        by_dtype[dtype] = by_dtype.get(dtype, 0) + size
        models[model]["bytes"] += size
        models[model]["by_form"][form] = models[model]["by_form"].get(form, 0) + size
    return {
        "total_bytes": sum(s for s, *_ in storages.values()),
        "by_form": by_form,
        "by_dtype": by_dtype,
        "models": models,
    }


def format_weights(report: dict) -> str:
    """The report as text: one line per model and form, then the total, in MiB."""
    mib = 2**20
    lines = [f"{'model':<8}{'form':<12}{'MiB':>10}"]
    for model, entry in report["models"].items():
        lines += [
            f"{model:<8}{form:<12}{size / mib:>10.2f}" for form, size in sorted(entry["by_form"].items())
        ]
    lines.append(f"{'total':<20}{report['total_bytes'] / mib:>10.2f}")
    return "\n".join(lines)
