"""A capture reused for another model of the same architecture, bound to that model's own weights.

Each capture is kept as a template on meta tensors (no weights, no model kept alive); a later model with the
same :func:`fingerprint` gets a copy bound to its own parameters and buffers by name. A model with forward
hooks (accelerate's dispatch, a user's) is never reused: a hook can change what the forward computes."""

from __future__ import annotations

import copy
import logging
import warnings
from collections import OrderedDict
from itertools import chain

import torch

log = logging.getLogger(__name__)

SCALARS = (bool, int, float, str, type(None), torch.dtype)
ENTRIES = 32  # architectures kept; a template is a graph with meta tensors, no weights: small


def _scalar_attributes(module: torch.nn.Module) -> tuple:
    """``(name, repr)`` of the module's public plain attributes (scalars and tuples/lists of scalars)."""
    out = []
    for name, value in sorted(vars(module).items()):
        if name.startswith("_") or name == "training":
            continue
        if isinstance(value, SCALARS) or (
            isinstance(value, (tuple, list)) and all(isinstance(v, SCALARS) for v in value)
        ):
            out.append((name, repr(value)))
    return tuple(out)


def _has_hooks(module: torch.nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or getattr(module, "_hf_hook", None))


def _global_hooks() -> bool:
    hooks = torch.nn.modules.module
    return bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks)


def named_tensors(module: torch.nn.Module):
    """``(name, tensor)`` of every parameter and buffer, tied ones under each of their names."""
    return chain(
        module.named_parameters(remove_duplicate=False), module.named_buffers(remove_duplicate=False)
    )


def fingerprint(model: torch.nn.Module, drop_softcap: bool) -> tuple | None:
    """What makes two captures one graph (classes, config, submodules' scalar attributes, tensor names,
    shapes, dtypes and devices, the softcap, torch and transformers versions); None: never reuse."""
    import transformers

    if _global_hooks():
        return None
    try:
        config = model.config.to_json_string(use_diff=False)
    except Exception:  # a configuration that cannot be written out cannot be compared either
        return None
    modules = []
    for name, module in model.named_modules(remove_duplicate=False):
        if _has_hooks(module):
            return None
        modules.append((name, type(module).__module__, type(module).__qualname__, _scalar_attributes(module)))
    tensors = tuple((name, tuple(t.shape), t.dtype, str(t.device)) for name, t in named_tensors(model))
    return (
        type(model).__module__,
        type(model).__qualname__,
        config,
        tuple(modules),
        tensors,
        drop_softcap,
        torch.__version__,
        transformers.__version__,
    )


def _quiet_deepcopy(graph_module: torch.fx.GraphModule, memo: dict) -> torch.fx.GraphModule:
    """A copy of the graph module, tensors replaced as ``memo`` says (export's specs and shape env shared)."""
    for name in ("_in_spec", "_out_spec", "shape_env", "range_constraints"):
        shared = graph_module.__dict__.get(name)
        if shared is not None:
            memo[id(shared)] = shared
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # copying a pytree spec warns about LeafSpec
        return copy.deepcopy(graph_module, memo)


def _on_meta(tensor: torch.Tensor) -> torch.Tensor:
    meta = torch.empty_like(tensor, device="meta")
    return torch.nn.Parameter(meta, requires_grad=False) if isinstance(tensor, torch.nn.Parameter) else meta


class CaptureCache:
    """Templates of recent captures, the least recently used dropped beyond :data:`ENTRIES`."""

    def __init__(self, entries: int = ENTRIES):
        self.entries = entries
        self._templates: OrderedDict = OrderedDict()
        self.hits = 0

    def clear(self) -> None:
        self._templates.clear()

    def put(self, key: tuple | None, graph_module: torch.fx.GraphModule) -> None:
        """Keep ``graph_module`` (just captured) as the template of ``key``, its weights on meta."""
        if key is None or self.entries <= 0:
            return
        memo = {id(t): _on_meta(t) for _, t in named_tensors(graph_module)}
        self._templates[key] = _quiet_deepcopy(graph_module, memo)
        self._templates.move_to_end(key)
        while len(self._templates) > self.entries:
            self._templates.popitem(last=False)

    def get(self, key: tuple | None, wrapper: torch.nn.Module) -> torch.fx.GraphModule | None:
        """A copy of the template bound to the tensors of ``wrapper`` (the module exported, the new model
        inside), or None when nothing fits."""
        template = self._templates.get(key) if key is not None else None
        if template is None:
            return None
        own = dict(named_tensors(wrapper))
        memo = {}
        for name, meta in named_tensors(template):
            tensor = own.get(name)
            if tensor is None or tensor.shape != meta.shape or tensor.dtype != meta.dtype:
                log.debug("capture template does not fit: %s", name)
                return None
            memo[id(meta)] = tensor
        self._templates.move_to_end(key)
        self.hits += 1
        return _quiet_deepcopy(template, memo)


CAPTURES = CaptureCache()
