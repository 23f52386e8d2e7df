"""Named tensors as one safetensors file, each storage once: tied names come back as aliases ``{alias:
written name}``, which reading binds to their name's tensor, so the ties hold again."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def model_tensors(gm: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the captured model by its name in the stage graphs (aliases included)."""
    tensors = dict(gm.named_parameters(remove_duplicate=False))
    tensors.update(dict(gm.named_buffers(remove_duplicate=False)))
    return {name: t.detach() for name, t in tensors.items()}


def save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Write ``tensors`` to ``path``, each storage once; returns ``{alias: written name}``."""
    unique, aliases, by_storage = {}, {}, {}
    for name in sorted(tensors):
        t = tensors[name]
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if t.numel() and key in by_storage:
            aliases[name] = by_storage[key]
            continue
        by_storage[key] = name
        unique[name] = t.to("cpu").contiguous().clone()  # safetensors refuses shared or strided storage
    save_file(unique, str(path))
    return aliases


def load_tensors(path: Path, aliases: dict[str, str], device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors :func:`save_tensors` wrote to ``path``, on ``device``, aliases bound to their tensors."""
    tensors = load_file(str(path), device=str(device))
    for alias, name in aliases.items():
        tensors[alias] = tensors[name]
    return tensors
