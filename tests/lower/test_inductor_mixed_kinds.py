"""Inductor on a model that mixes attention layer kinds and softcaps its logits (tiny Gemma 2): the
eager tokens for AR, SD and SSD, zero graph breaks, the attention math (masks per kind, softcap)
inlined for Inductor to fuse. One small test: C++ compiles are slow on CPU."""

import pytest
import torch
from torch._dynamo.utils import counters

import saguaro
from saguaro.core.stages import TARGET_VERIFY
from saguaro.capture.attention_op import ATTENTION_OPS
from saguaro.passes.lower_attention import attention_inline
from tests.models import WINDOW, family_draft, prompts, reference_greedy, tiny_family_target


@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_inductor_equals_eager_on_mixed_kinds_without_graph_breaks():
    target = tiny_family_target("gemma2")
    draft = family_draft(target)
    ids, mask = prompts(2, 7, seed=2, pad_rows={1: 2})
    new = 3 * WINDOW
    expected = reference_greedy(target, ids, mask, new)
    # a fixed tree of 8 branches: one tree shape, and SSD's draft store in SD's capacity bucket (one compile
    # per stage; the planner's many tree shapes are not this test's subject)
    options = dict(k=3, mode="ssd", lane="thread", fan_out="geometric", fan_out_budget=8, sd_when_faster=False)
    eager = saguaro.compile(target, draft, backend="eager", **options)
    compiled = saguaro.compile(target, draft, backend="inductor", **options)
    try:
        counters.clear()
        for mode in ("ar", "sd", "ssd"):
            want = eager.generate(ids, attention_mask=mask, max_new_tokens=new, mode=mode, eos_token_id=None)
            got = compiled.generate(ids, attention_mask=mask, max_new_tokens=new, mode=mode, eos_token_id=None)
            assert torch.equal(want.sequences, expected)
            assert torch.equal(got.sequences, want.sequences), f"inductor {mode} differs from eager"
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
        assert counters["stats"]["unique_graphs"] >= 4  # the stages really went through dynamo
        verify = compiled.target.stage(TARGET_VERIFY.greedy).gm
        lowered = [n for n in verify.graph.nodes if n.op == "call_function" and n.target is attention_inline]
        assert len(lowered) == 2 and all(n.args[8] == 1.0 for n in lowered)  # the softcap, inlined
        assert not any(n.target in ATTENTION_OPS for n in verify.graph.nodes if n.op == "call_function")
    finally:
        eager.close()
        compiled.close()
