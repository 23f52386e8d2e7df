"""lower_attention: which nodes it rewrote, and results (outputs and KV writes) equal to the op's."""

import copy

import pytest
import torch

from saguaro.capture.attention_op import ATTENTION_OP
from saguaro.core.stages import stage_named
from saguaro.passes.base.graph_splice import PassError
from saguaro.passes.lower_attention import attention_flex, attention_inline, flex_block_mask, lower_attention
from saguaro.passes.pipeline import build_stage
from tests.passes.stage_helpers import base_graph, call, count, prefilled_store

PROMPT = torch.tensor([[5, 9, 17, 33, 41], [7, 7, 3, 90, 12]])
SPEC = torch.tensor([[12, 77, 3, 64], [8, 8, 100, 5]])


def spec_index():
    return torch.arange(5, 9).expand(2, 4).contiguous()


def test_inline_rewrites_every_attention_node_and_op_keeps_them():
    _, captured = base_graph()
    kept = build_stage(captured.graph_module, stage_named("target.verify_greedy"), 8, attention="op")
    inlined = build_stage(captured.graph_module, stage_named("target.verify_greedy"), 8, attention="inline")
    assert count(kept, ATTENTION_OP) == 2 and count(kept, attention_inline) == 0
    assert count(inlined, ATTENTION_OP) == 0 and count(inlined, attention_inline) == 2
    assert len(inlined.graph.nodes) == len(kept.graph.nodes)  # a one-for-one rewrite


def test_flex_builds_one_block_mask_and_drops_the_additive_mask():
    _, captured = base_graph()
    for stage in map(stage_named, ("target.verify_greedy", "draft.tree_greedy")):
        kept = build_stage(captured.graph_module, stage, 8, attention="op")
        flex = build_stage(captured.graph_module, stage, 8, attention="flex")
        assert count(flex, ATTENTION_OP) == 0 and count(flex, attention_flex) == 2
        assert count(flex, flex_block_mask) == 1  # one per forward, read by every layer
        fills = lambda gm: sum(1 for n in gm.graph.nodes if "masked_fill" in str(n.target))
        assert fills(kept) >= 1 and fills(flex) == 0, "the dense additive mask is still built"
        assert len(flex.graph.nodes) < len(kept.graph.nodes)


@torch.no_grad()  # as the runtime calls stages (FlexAttention has no CPU backward)
def stage_results(stage, implementation):
    """Outputs of ``stage`` on a prefilled store, and the KV caches it left."""
    _, captured = base_graph()
    spec = stage_named(stage)
    gm = build_stage(captured.graph_module, spec, 8, attention=implementation)
    store = prefilled_store(captured.spec, PROMPT)
    if spec.mask == "tree":  # two branches forked after the prompt, one token deep
        ids, index = SPEC[:, :2], torch.tensor([[5, 6], [5, 6]])
        out = call(
            gm, store, ids, index, branch=torch.tensor([[1, 2], [1, 2]]), limit=torch.tensor([[4, 4], [4, 4]])
        )
    elif stage == "draft.glue":
        extra = (SPEC[:, 1:], torch.tensor([0, 1, 3]), torch.tensor([0, 0, 0]))
        out = call(gm, store, SPEC, spec_index(), *extra)
    elif stage == "target.verify_greedy":
        out = call(gm, store, SPEC, spec_index(), SPEC[:, 1:])
    else:
        out = call(gm, store, SPEC[:, :1], spec_index()[:, :1])
    return out, [c.clone() for c in store.k_caches + store.v_caches]


@pytest.mark.parametrize("implementation", ["inline", "flex", "reduce"])
@pytest.mark.parametrize(
    "stage", ["target.verify_greedy", "draft.glue", "draft.tree_greedy", "draft.step_greedy", "target.step"]
)
def test_lowered_attention_gives_the_op_outputs_and_kv_writes(stage, implementation):
    op_out, op_caches = stage_results(stage, "op")
    out, caches = stage_results(stage, implementation)
    exact = implementation == "inline"  # flex and reduce sum in another order: equal up to float rounding
    assert len(op_out) == len(out) and len(op_caches) == len(caches)
    for a, b in zip(op_out, out):
        if exact or a.dtype == torch.long:
            assert torch.equal(a, b), f"{implementation} changed a {stage} output"
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    layers = len(op_caches) // 2
    for i, (a, b) in enumerate(zip(op_caches, caches)):
        if exact or i % layers == 0:  # the first layer's K/V come from the embeddings alone
            assert torch.equal(a, b), f"{implementation} wrote the KV store differently"
        else:  # later layers' K/V carry the earlier layers' rounding
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert any(bool(c[:, :, 5].abs().sum() > 0) for c in caches), "nothing was written at slot 5"


def test_lower_attention_rejects_unknown_implementations_and_lowered_graphs():
    _, captured = base_graph()
    gm = build_stage(captured.graph_module, stage_named("draft.step_greedy"), 8, attention="inline")
    with pytest.raises(
        ValueError, match="implementation='flash' is not allowed: choose one of op, inline, flex, reduce"
    ):
        lower_attention(copy.deepcopy(gm), "flash")
    with pytest.raises(PassError, match="no saguaro::attention node"):
        lower_attention(gm, "inline")


@pytest.mark.heavy
@pytest.mark.parametrize("attention", ["inline", "flex"])
def test_programs_with_lowered_attention_give_the_reference_tokens(attention):
    import saguaro
    from tests.models import prompts, reference_greedy, tiny_target, truncated_draft

    target = tiny_target("llama", seed=3)
    draft = truncated_draft(target)
    ids, mask = prompts(2, 7, seed=2, pad_rows={1: 2})
    expected = reference_greedy(target, ids, mask, 10)
    program = saguaro.compile(
        target,
        draft,
        k=3,
        mode="ssd",
        lane="thread",
        attention=attention,
        backend="eager",
        sd_when_faster=False,
    )
    try:
        for mode in ("ar", "sd", "ssd"):
            out = program.generate(ids, attention_mask=mask, max_new_tokens=10, mode=mode, eos_token_id=None)
            assert torch.equal(out.sequences, expected), f"{attention} attention changed {mode}'s tokens"
    finally:
        program.close()
