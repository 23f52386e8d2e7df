"""A captured model (before any pass) as files a draft process reads without ``transformers``: the graph as
:mod:`~saguaro.capture.graph_file` JSON, its tensors as safetensors and its ModelSpec as JSON (why:
docs/measurements/2026-12-02-lane-checks-and-draft-start.md)."""

from __future__ import annotations

import os
from dataclasses import asdict
from operator import attrgetter

import torch

from saguaro.capture import graph_file
from saguaro.capture.export import CapturedModel, ModelSpec
from saguaro.capture.layer_kinds import LayerKind
from saguaro.core.tensor_files import load_tensors, save_tensors

GRAPH, TENSORS = "graph.json", "tensors.safetensors"


class CapturedSource:
    """A capture kept for a draft process: graph JSON text, the tensors it reads (not copies), the spec."""

    def __init__(self, text: str, tensors: dict[str, torch.Tensor], spec: ModelSpec):
        self.text, self.tensors, self.spec = text, tensors, spec

    @classmethod
    def of(cls, captured: CapturedModel) -> CapturedSource | None:
        """The source of a fresh capture (before any pass), or None when its graph has no JSON form."""
        gm = captured.graph_module
        try:
            text = graph_file.dumps(gm)
        except graph_file.NotKept:
            return None
        return cls(
            text, {name: attrgetter(name)(gm) for name in graph_file.attribute_names(gm)}, captured.spec
        )

    def save(self, directory: str) -> dict:
        """Write the files to ``directory``; returns their description (names, aliases, spec)."""
        with open(os.path.join(directory, GRAPH), "w") as f:
            f.write(self.text)
        aliases = save_tensors(
            os.path.join(directory, TENSORS), {k: t.detach() for k, t in self.tensors.items()}
        )
        parameters = sorted(k for k, t in self.tensors.items() if isinstance(t, torch.nn.Parameter))
        return {
            "directory": directory,
            "aliases": aliases,
            "parameters": parameters,
            "spec": spec_json(self.spec),
        }


def load_captured(description: dict, device: torch.device) -> CapturedModel:
    """The captured model :meth:`CapturedSource.save` described, its tensors on ``device``."""
    directory = description["directory"]
    tensors = load_tensors(os.path.join(directory, TENSORS), description["aliases"], device)
    parameters = {
        name: torch.nn.Parameter(tensors[name], requires_grad=False) for name in description["parameters"]
    }
    for alias, name in description["aliases"].items():  # a tie between parameters stays one Parameter
        if name in parameters:
            parameters[alias] = parameters[name]
    tensors.update(parameters)
    with open(os.path.join(directory, GRAPH)) as f:
        graph_module = graph_file.loads(f.read(), tensors)
    return CapturedModel(graph_module=graph_module, spec=spec_from_json(description["spec"], device))


def spec_json(spec: ModelSpec) -> dict:
    d = asdict(spec)
    d["dtype"] = str(spec.dtype).removeprefix("torch.")
    d["device"] = str(spec.device)
    return d


def spec_from_json(data: dict, device: torch.device) -> ModelSpec:
    return ModelSpec(
        **dict(
            data,
            dtype=getattr(torch, data["dtype"]),
            device=device,
            layer_kinds=tuple(LayerKind(**kind) for kind in data["layer_kinds"]),
        )
    )
