"""mutated_inputs: the inputs a stage graph writes in place are exactly its KV caches, whichever way
attention is lowered; writes are found through views, and reads or writes of copies do not count."""

import operator

import pytest
import torch

from saguaro.core.stages import DRAFT_GLUE, DRAFT_STEP, DRAFT_TREE, TARGET_VERIFY
from saguaro.lower.graph_inputs import mutated_inputs
from saguaro.passes.pipeline import build_stage
from saguaro.tensor_math.fork import RANK_WIDTH
from tests.passes.stage_helpers import base_graph

CAPTURED_INPUTS = 7  # input_ids, positions, write_slots, query_branch, query_limit, slot_pos, slot_branch


@pytest.mark.parametrize("attention", ["op", "inline", "flex"])
@pytest.mark.parametrize(
    "stage",
    [TARGET_VERIFY.greedy, DRAFT_GLUE, DRAFT_TREE.sampled, DRAFT_STEP.greedy],
    ids=lambda s: s.qualified,
)
def test_the_kv_caches_are_the_mutated_inputs_of_every_stage_graph(stage, attention):
    _, captured = base_graph()
    gm = build_stage(captured.graph_module, stage, min(captured.spec.vocab_size, RANK_WIDTH), attention)
    layers = captured.spec.num_layers
    assert mutated_inputs(gm) == tuple(range(CAPTURED_INPUTS, CAPTURED_INPUTS + 2 * layers))


def _graph(build, inputs=3):
    graph = torch.fx.Graph()
    xs = [graph.placeholder(f"x{i}") for i in range(inputs)]
    graph.output(build(graph, xs))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_in_place_methods_setitem_augmented_assignment_and_out_are_writes():
    def build(g, xs):
        g.call_method("add_", (xs[0], 1))
        g.call_function(operator.setitem, (xs[1], 0, 5.0))
        g.call_function(operator.imul, (g.call_function(torch.transpose, (xs[3], 0, 1)), 2))
        return (g.call_function(torch.add, (xs[2], 1), {"out": xs[2]}),)

    assert mutated_inputs(_graph(build, inputs=5)) == (0, 1, 2, 3)


def test_writes_through_views_and_op_schemas_are_found():
    def build(g, xs):
        row = g.call_function(operator.getitem, (xs[0], 0))
        g.call_method("zero_", (g.call_method("view", (row, -1)),))
        flat = g.call_function(torch.ops.aten.view.default, (xs[1], [-1]))
        index = g.call_function(torch.ops.aten.zeros.default, ([1],), {"dtype": torch.long})
        g.call_function(torch.ops.aten.index_put_.default, (flat, [index], xs[2]))
        return (xs[2],)

    assert mutated_inputs(_graph(build)) == (0, 1)  # x2 is only read


def test_writes_to_new_tensors_and_reads_are_not_writes():
    def build(g, xs):
        copy = g.call_method("clone", (xs[0],))
        g.call_method("mul_", (copy, 2))  # a copy of x0
        total = g.call_function(torch.add, (xs[1], xs[2]))
        g.call_method("__getitem__", (xs[1], 0))  # a dunder is not an in-place method
        return (g.call_method("add_", (total, 1)),)

    assert mutated_inputs(_graph(build)) == ()


def test_an_overload_packet_with_one_schema_is_read_like_its_overload():
    def build(g, xs):
        g.call_function(torch.ops.aten.fill_, (xs[1], 0.0))  # the packet: overloads Scalar and Tensor
        g.call_function(torch.ops.aten.relu_, (xs[2],))  # the packet: one overload, "default"
        return (xs[0],)

    found = mutated_inputs(_graph(build))
    assert 2 in found and 0 not in found
    assert 1 in found  # a packet with several overloads falls back to its name: fill_ ends with "_"


def test_the_op_graphs_writes_are_found_by_schema_whatever_the_inputs_are_called():
    _, captured = base_graph()
    gm = build_stage(captured.graph_module, TARGET_VERIFY.greedy, 8, "op")
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.target = f"input_{node.name}"  # no longer the flat signature's names
    layers = captured.spec.num_layers
    assert mutated_inputs(gm) == tuple(range(CAPTURED_INPUTS, CAPTURED_INPUTS + 2 * layers))


def write_first(cache, values, scale=1.0):
    cache.copy_(values * scale)
    return values


write_first.mutates_args = ("cache",)


def test_a_python_function_declares_what_it_writes_with_mutates_args():
    def build(g, xs):
        return (g.call_function(write_first, (xs[1],), {"values": xs[0]}),)

    assert mutated_inputs(_graph(build)) == (1,)


def test_the_stage_contract_marks_the_cache_inputs_even_without_a_visible_write():
    graph = torch.fx.Graph()
    names = ["input_ids", "k_caches_0", "v_caches_0", "k_caches", "draft_tokens", "k_cachesx"]
    nodes = [graph.placeholder(name) for name in names]
    graph.output((nodes[0],))
    assert mutated_inputs(torch.fx.GraphModule(torch.nn.Module(), graph)) == (1, 2, 3)


def test_writes_to_attributes_and_list_items_are_traced_to_their_source():
    graph = torch.fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    graph.call_method("add_", (graph.get_attr("weight"),))  # the module's own tensor, not an input
    graph.call_method("add_", (graph.call_function(operator.getitem, ([x, y], 1)), 1))
    graph.call_method("add_", (graph.call_function(operator.getitem, ((1.0, 2.0), 0)), 1))  # not a tensor's
    graph.output((x,))
    module = torch.nn.Module()
    module.register_buffer("weight", torch.zeros(2))
    assert mutated_inputs(torch.fx.GraphModule(module, graph)) == (1,)
