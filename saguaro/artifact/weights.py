"""A model's weights, written once per model as safetensors and shared by all of its stages.

Tied tensors (one storage under several names, e.g. tied embeddings) are written once; the manifest
records the other names as aliases.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def model_tensors(gm: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the captured model by its name in the stage graphs (aliases included)."""
    tensors = dict(gm.named_parameters(remove_duplicate=False))
    tensors.update(dict(gm.named_buffers(remove_duplicate=False)))
    return {name: t.detach() for name, t in tensors.items()}


def save_weights(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
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


def load_weights(path: Path, aliases: dict[str, str], device: torch.device) -> dict[str, torch.Tensor]:
    tensors = load_file(str(path), device=str(device))
    for alias, name in aliases.items():
        tensors[alias] = tensors[name]
    return tensors
