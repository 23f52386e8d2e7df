"""strip_runtime_checks: which nodes it removes, and outputs identical to the graph before it."""

import copy

import torch

from saguaro.capture import capture
from saguaro.passes.strip_runtime_checks import ASSERT_OPS, TO_DTYPE, strip_runtime_checks
from saguaro.runtime.base.kv_store import KVStore
from tests.models import tiny_target


def count(gm, targets):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in targets)


def run(gm, spec, ids):
    store = KVStore(spec, batch=ids.shape[0], capacity=16)
    index = torch.arange(ids.shape[1]).expand_as(ids).contiguous()
    store.claim(index, index, torch.zeros_like(index))
    return gm(
        ids,
        index,
        index,
        torch.zeros_like(index),
        index,
        store.slot_pos,
        store.slot_branch,
        store.k_caches,
        store.v_caches,
    )


def test_removes_asserts_and_noop_conversions_only():
    captured = capture(tiny_target("llama"))
    before = copy.deepcopy(captured.graph_module)
    asserts, conversions = count(before, ASSERT_OPS), count(before, {TO_DTYPE})
    assert asserts > 0 and conversions > 0
    after = strip_runtime_checks(captured.graph_module)
    assert count(after, ASSERT_OPS) == 0
    remaining = [n for n in after.graph.nodes if n.op == "call_function" and n.target is TO_DTYPE]
    # in a float32 model only the positions' int64 -> float32 conversion (RoPE) converts anything
    assert [n.args[0].meta["val"].dtype for n in remaining] == [torch.int64]
    assert len(after.graph.nodes) == len(before.graph.nodes) - asserts - (conversions - 1)
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(run(after, captured.spec, ids), run(before, captured.spec, ids))


def test_keeps_real_conversions():
    model = tiny_target("llama").to(torch.bfloat16)
    gm = strip_runtime_checks(capture(model).graph_module)
    remaining = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is TO_DTYPE]
    assert remaining, "bf16 RMSNorm upcasts to float32 and back: those conversions must stay"
    assert all(n.args[0].meta["val"].dtype != n.args[1] for n in remaining)
