"""``graph_file``: the capture cache's JSON form of a captured graph. Read back, every architecture's
graph has the captured graph's code (less export's input-guard call), computes the same logits bit for
bit with the same weights, and keeps each node's dtype and the metadata the passes and the inspector
read; a graph it cannot write is refused by name, and a file of another version is refused."""

import json

import pytest
import torch

from saguaro.capture import graph_file
from saguaro.capture.export import _StageForward, capture, example_inputs, model_spec
from tests.models import FAMILIES, tiny_family_target, tiny_target


def _models():
    """A Llama, and a target of every family with more than a Llama has (sliding windows, softcaps,
    sinks, chunked attention; GPT-OSS's graph indexes tuples with ``operator.getitem``)."""
    yield "llama", tiny_target("llama")
    for family in FAMILIES:
        yield family, tiny_family_target(family)


def test_every_architecture_comes_back_with_the_same_code_logits_and_metadata(no_capture_cache):
    for name, model in _models():  # each captured afresh by torch.export: the graphs compared are export's
        captured = capture(model).graph_module
        spec = model_spec(model)
        read = graph_file.loads(graph_file.dumps(captured), _StageForward(model, spec))
        tensors = 0
        expected = [line for line in captured.code.splitlines() if "_guards_fn" not in line]
        assert read.code.splitlines() == expected, name
        for before, after in zip(
            (n for n in captured.graph.nodes if n.op != "call_module"), read.graph.nodes
        ):
            val = before.meta.get("val")
            if isinstance(val, torch.Tensor):
                assert after.meta["val"].dtype == val.dtype and len(after.meta["val"].shape) == val.dim(), (
                    after
                )
                tensors += 1
            assert after.meta.get("nn_module_stack") == before.meta.get("nn_module_stack"), after
        assert tensors > len(captured.graph.nodes) // 2, (
            name,
            tensors,
        )  # export's fake tensors were compared
        with torch.no_grad():
            inputs = example_inputs(spec)
            want = captured(
                *[x.clone() if isinstance(x, torch.Tensor) else [t.clone() for t in x] for x in inputs]
            )
            got = read(
                *[x.clone() if isinstance(x, torch.Tensor) else [t.clone() for t in x] for x in inputs]
            )
        assert torch.equal(
            torch.as_tensor(got[0] if isinstance(got, tuple) else got),
            torch.as_tensor(want[0] if isinstance(want, tuple) else want),
        ), name


def test_a_graph_calling_a_python_function_is_not_kept_and_says_which_node():
    class Relu(torch.nn.Module):
        def forward(self, x):
            return torch.relu(x)

    traced = torch.fx.symbolic_trace(Relu())
    with pytest.raises(graph_file.NotKept, match="pytree"):
        graph_file.dumps(traced)  # not export's signature
    exported = torch.export.export(Relu(), (torch.ones(2),)).module()
    node = next(n for n in exported.graph.nodes if n.op == "call_function")
    node.target = torch.relu  # a Python callable where export writes an operator overload
    with pytest.raises(graph_file.NotKept, match=f"node {node.name} calls"):
        graph_file.dumps(exported)


def test_a_file_of_another_version_is_refused():
    exported = torch.export.export(torch.nn.ReLU(), (torch.ones(2),)).module()
    data = json.loads(graph_file.dumps(exported))
    assert graph_file.loads(json.dumps(data), torch.nn.ReLU())(torch.tensor([-1.0, 2.0])).tolist() == [
        0.0,
        2.0,
    ]
    with pytest.raises(ValueError, match="version 99"):
        graph_file.loads(json.dumps({**data, "version": 99}), torch.nn.ReLU())
