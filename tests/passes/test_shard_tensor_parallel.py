"""The ``shard_tensor_parallel`` pass's graph, without running it (no process group needed: the
collectives only name the group): one all-reduce right after each row-parallel projection, each
projection's parameter sliced to the rank's heads, and head counts that do not divide refused."""

import pytest
import torch

from saguaro.capture import capture
from saguaro.core.errors import CaptureError
from saguaro.passes import run_pipeline
from saguaro.passes.base.graph_pass import TENSOR_PARALLEL, copy_graph, record_of
from saguaro.passes.base.graph_splice import PassError
from saguaro.passes.shard_tensor_parallel import (
    ALL_REDUCE,
    LINEAR,
    WAIT,
    Shard,
    ShardTensorParallel,
    count_all_reduces,
    local_spec,
)
from tests.models import tiny_target


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def captured(request):
    model = capture(tiny_target(request.param))
    model.graph_module = run_pipeline(model.graph_module)
    return request.param, model


def sharded(model, rank: int, world: int = 2):
    """Rank ``rank``'s graph: a copy of the base graph (its own parameter slots), sharded."""
    return ShardTensorParallel(model.spec, Shard(rank, world, "tp_test"))(copy_graph(model.graph_module))


def test_one_all_reduce_after_each_row_parallel_projection(captured):
    arch, model = captured
    spec = model.spec
    gm = sharded(model, rank=1)
    assert TENSOR_PARALLEL in record_of(gm).facts
    # exactly one per row-parallel projection: o_proj and down_proj of each layer
    assert count_all_reduces(gm) == 2 * spec.num_layers
    reduced = [n for n in gm.graph.nodes if n.target is ALL_REDUCE]
    for node in reduced:
        source = node.args[0]
        assert source.target is LINEAR and node.args[1:] == ("sum", "tp_test")
        assert source.args[1].target.endswith(("o_proj.weight", "down_proj.weight")), source.args[1].target
        assert [u.target for u in node.users] == [WAIT]  # waited on once, and nothing reads the raw sum
        assert list(source.users) == [node]
    # no all-reduce anywhere else: column-parallel projections and the LM head are not reduced
    linears = [n for n in gm.graph.nodes if n.target is LINEAR]
    assert sum(1 for n in linears if any(u.target is ALL_REDUCE for u in n.users)) == 2 * spec.num_layers


def test_parameters_hold_the_ranks_slice(captured):
    arch, model = captured
    spec, full = model.spec, model.graph_module
    world, D = 2, spec.head_dim
    q_rows, kv_rows = spec.num_heads // world * D, spec.num_kv_heads // world * D
    for rank in range(world):
        gm = sharded(model, rank)
        params = dict(gm.named_parameters())
        for name, value in params.items():
            whole = full.get_parameter(name)
            if "q_proj.weight" in name or "q_proj.bias" in name:
                assert torch.equal(value, whole[rank * q_rows : (rank + 1) * q_rows])
            elif any(p in name for p in ("k_proj", "v_proj")):
                assert torch.equal(value, whole[rank * kv_rows : (rank + 1) * kv_rows])
            elif "o_proj.weight" in name:
                assert torch.equal(value, whole[:, rank * q_rows : (rank + 1) * q_rows])
            elif "down_proj.weight" in name:
                half = whole.shape[1] // world
                assert torch.equal(value, whole[:, rank * half : (rank + 1) * half])
            elif "gate_proj" in name or "up_proj" in name:
                half = whole.shape[0] // world
                assert torch.equal(value, whole[rank * half : (rank + 1) * half])
            else:  # embeddings, norms, LM head: replicated
                assert value is whole or torch.equal(value, whole), name
    if arch == "qwen2":  # q/k/v biases are column-parallel too
        assert any("q_proj.bias" in name for name in params)
    assert local_spec(spec, world).num_kv_heads == spec.num_kv_heads // world


def test_indivisible_head_counts_are_refused_naming_them(captured):
    _, model = captured
    spec = model.spec  # 4 query heads, 2 KV heads
    with pytest.raises(
        CaptureError, match=r"num_attention_heads=4 and num_key_value_heads=2 do not divide by 3"
    ):
        ShardTensorParallel(spec, Shard(0, 3, "g"))
    with pytest.raises(CaptureError, match=r"num_key_value_heads=2 does not divide by 4"):
        local_spec(spec, 4)


def test_a_parameter_it_cannot_place_is_refused_naming_the_node(captured):
    _, model = captured
    gm = copy_graph(model.graph_module)
    node = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target.endswith("mlp.up_proj.weight"))
    gm.register_parameter(
        "fused_qkv", torch.nn.Parameter(gm.get_parameter(node.target).clone(), requires_grad=False)
    )
    node.target = "fused_qkv"
    user = next(iter(node.users))
    with pytest.raises(
        PassError, match=rf"node {user.name} .* the parameter fused_qkv, which the pass cannot place"
    ):
        ShardTensorParallel(model.spec, Shard(0, 2, "g"))(gm)
