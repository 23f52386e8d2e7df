"""lower_attention: which nodes it rewrote, and results (outputs and KV writes) equal to the op's."""

import copy

import pytest
import torch

from saguaro.capture.attention_op import ATTENTION_OP
from saguaro.passes.graph_splice import PassError
from saguaro.passes.lower_attention import attention_inline, lower_attention
from saguaro.passes.pipeline import STAGES, build_stage
from tests.passes.stage_helpers import base_graph, call, count, prefilled_store

PROMPT = torch.tensor([[5, 9, 17, 33, 41], [7, 7, 3, 90, 12]])
SPEC = torch.tensor([[12, 77, 3, 64], [8, 8, 100, 5]])


def spec_index():
    return torch.arange(5, 9).expand(2, 4).contiguous()


def test_inline_rewrites_every_attention_node_and_op_keeps_them():
    _, captured = base_graph()
    kept = build_stage(captured.graph_module, "verify_greedy", 8, attention="op")
    inlined = build_stage(captured.graph_module, "verify_greedy", 8, attention="inline")
    assert count(kept, ATTENTION_OP) == 2 and count(kept, attention_inline) == 0
    assert count(inlined, ATTENTION_OP) == 0 and count(inlined, attention_inline) == 2
    assert len(inlined.graph.nodes) == len(kept.graph.nodes)  # a one-for-one rewrite


@pytest.mark.parametrize("stage", ["verify_greedy", "glue", "tree_greedy", "step_greedy"])
def test_inline_gives_the_same_outputs_and_kv_writes_as_the_op(stage):
    _, captured = base_graph()
    spec = STAGES[stage]
    results = []
    for implementation in ("op", "inline"):
        gm = build_stage(captured.graph_module, stage, 8, attention=implementation)
        store = prefilled_store(captured.spec, PROMPT)
        if spec.mask == "tree":  # two branches forked after the prompt, one token deep
            ids, index = SPEC[:, :2], torch.tensor([[5, 6], [5, 6]])
            out = call(gm, store, ids, index, branch=torch.tensor([[1, 2], [1, 2]]),
                       limit=torch.tensor([[4, 4], [4, 4]]))
        elif stage == "glue":
            extra = (SPEC[:, 1:], torch.tensor([0, 1, 3]), torch.tensor([0, 0, 0]))
            out = call(gm, store, SPEC, spec_index(), *extra)
        elif stage == "verify_greedy":
            out = call(gm, store, SPEC, spec_index(), SPEC[:, 1:])
        else:
            out = call(gm, store, SPEC[:, :1], spec_index()[:, :1])
        results.append((out, [c.clone() for c in store.k_caches + store.v_caches]))
    (op_out, op_caches), (inline_out, inline_caches) = results
    for a, b in zip(op_out, inline_out):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(op_caches, inline_caches):
        assert torch.equal(a, b), "the inlined attention wrote the KV store differently"
    assert any(bool(c[:, :, 5].abs().sum() > 0) for c in inline_caches), "nothing was written at slot 5"


def test_lower_attention_rejects_unknown_implementations_and_lowered_graphs():
    _, captured = base_graph()
    gm = build_stage(captured.graph_module, "step_greedy", 8, attention="inline")
    with pytest.raises(ValueError, match="implementation='flash' is not allowed: choose one of op, inline"):
        lower_attention(copy.deepcopy(gm), "flash")
    with pytest.raises(PassError, match="no saguaro::attention node"):
        lower_attention(gm, "inline")
