"""The draft handed to a draft process as files, never by pickling the caller's objects: its capture's
file form, else its config, weights and buffers and its classes by import path, rebuilt bit for bit."""

from __future__ import annotations

import importlib
import os

import torch
from safetensors.torch import load_file, save_file

from saguaro.core.errors import SaguaroError
from saguaro.core.tensor_files import load_tensors, save_tensors


class RemoteDraftError(SaguaroError):
    """The draft cannot be rebuilt in another process (for example its class is defined in ``__main__``)."""


def class_path(cls: type) -> tuple[str, str]:
    """``(module, qualname)`` of a class another process can import, or ``RemoteDraftError``."""
    module, name = cls.__module__, cls.__qualname__
    if module == "__main__" or "<locals>" in name:
        where = "the script's __main__" if module == "__main__" else f"a function body ({name})"
        raise RemoteDraftError(
            f"draft class {cls.__name__} is defined in {where}, which the draft process does not import; "
            "define it in an importable module to use lane='process'"
        )
    return module, name


def import_class(module: str, name: str) -> type:
    try:
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise RemoteDraftError(f"the draft process cannot import {module}.{name}: {exc}") from exc
    return obj


class RemoteDraft:
    """What a process lane rebuilds the draft side from: the model (kept in the caller), backend and
    attention, and the capture's ``source`` when it has files of its own."""

    def __init__(self, model: torch.nn.Module, backend: str, attention: str, source=None):
        self.model, self.backend, self.attention, self.source = model, backend, attention, source

    def save(self, directory: str) -> dict:
        """Write the draft to ``directory``; return the description the draft process loads it from."""
        described = {
            "backend": self.backend,
            "attention": self.attention,
            "device": str(next(self.model.parameters()).device),
        }
        if self.source is not None:
            return dict(
                self.source.save(directory), server="saguaro.compile:captured_draft_server", **described
            )
        model = self.model
        aliases = save_tensors(os.path.join(directory, "model.safetensors"), model.state_dict())
        description = dict(
            described,
            model_class=class_path(type(model)),
            config_class=class_path(type(model.config)),
            directory=directory,
            aliases=aliases,
            dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        )
        model.config.to_json_file(os.path.join(directory, "config.json"))
        buffers = {name: b.detach().to("cpu", copy=True).contiguous() for name, b in model.named_buffers()}
        save_file(buffers, os.path.join(directory, "buffers.safetensors"))
        return description


def load_draft(description: dict) -> torch.nn.Module:
    """In the draft process: the model a :meth:`RemoteDraft.save` without a capture source wrote."""
    model_cls = import_class(*description["model_class"])
    config_cls = import_class(*description["config_class"])
    directory, device = description["directory"], torch.device(description["device"])
    dtype = getattr(torch, description["dtype"])
    config = config_cls.from_json_file(os.path.join(directory, "config.json"))
    with _no_init_weights():
        model = model_cls._from_config(config, dtype=dtype)
    model.tie_weights()  # as the caller's model is, where the config ties them
    model.to(device)
    state = load_tensors(os.path.join(directory, "model.safetensors"), description["aliases"], device)
    model.load_state_dict(state, strict=True)
    for name, buffer in load_file(os.path.join(directory, "buffers.safetensors"), device=str(device)).items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        module._buffers[attr] = buffer  # the caller's exact buffer: value and dtype
    return model.eval()


def _no_init_weights():
    """Skip random initialisation (every weight is loaded next); a no-op where transformers lacks it."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - older transformers
        from contextlib import nullcontext

        return nullcontext()
    return no_init_weights()
