"""A graph break inductor cannot remove raises a SaguaroError naming the stage and the FX node."""

import pytest
import torch

from saguaro.core.errors import SaguaroError
from saguaro.lower.lowering import lower_graph


def host_round_trip(x):
    torch._dynamo.graph_break()  # what an untraceable host call looks like to dynamo
    return x + 1


def test_graph_break_names_stage_and_node():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.sin, (x,))
    z = graph.call_function(host_round_trip, (y,))
    graph.output(z)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    stage = lower_graph(gm, "inductor", "draft.test")
    with pytest.raises(SaguaroError, match=r"stage draft\.test at FX node 'host_round_trip'"):
        stage(torch.ones(3))


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend='tvm' is not allowed: choose one of eager, inductor"):
        lower_graph(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()), "tvm", "x")
