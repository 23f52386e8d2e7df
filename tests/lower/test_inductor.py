"""Inductor lowering on a model that mixes attention layer kinds and softcaps its logits (tiny Gemma 2):
the eager tokens for AR, SD and SSD, greedy and sampled (one seed, the same uniforms, the same tokens),
zero graph breaks, stage calls past dynamo (``direct_call.py``), the attention math (masks per kind,
softcap) inlined for Inductor to fuse, the one-row stages' linears as fused reductions
(``linear_as_reduction``) and the several-row stages' as the packed kernel (``pack_linears``), both reading
weights held as bfloat16 (``narrow_weights``, the panels), and ``saguaro inspect kernels`` over what it
generated.

The suite's test of Inductor-compiled generation (C++ on CPU, about ten seconds per stage graph); it is
slow by nature, so it covers every mode and both verifications in one go. Gemma 2's
layers hold what a Llama's do (global attention, RoPE, GQA) and more (sliding windows, softcaps); the
AOTInductor packages of ``tests/artifact`` compile a Llama's AR stages.
"""

import os

import pytest
import torch
from torch._dynamo.utils import counters

import saguaro
from saguaro.capture.attention_op import ATTENTION_OPS
from saguaro.core.stages import DRAFT_CHAIN, TARGET_PREFILL, TARGET_ROUND, TARGET_VERIFY_ROUND, stages_for
from saguaro.passes.linear_as_reduction import LINEAR
from saguaro.passes.lower_attention import attention_kernel
from saguaro.passes.pack_linears import ATTRIBUTE_PREFIX as PANELS
from saguaro.tensor_math.packed_linear import available
from tests.models import WINDOW, family_draft, prompts, reference_greedy, tiny_family_target


@pytest.mark.heavy
@pytest.mark.timeout(900)  # about 2-3 min with an empty Inductor cache on a 2-core CPU (C++ compiles)
def test_inductor_equals_eager_for_every_mode_without_graph_breaks():
    assert available()  # the packed kernel builds here (else the several-row stages keep the reductions)
    PACKED = torch.ops.saguaro_kernels.packed_linear.default
    target = tiny_family_target("gemma2")
    draft = family_draft(target)
    with (
        torch.no_grad()
    ):  # bfloat16 values, as a bfloat16 checkpoint loaded as float32: narrow_weights holds them so
        for p in (*target.parameters(), *draft.parameters()):
            p.copy_(p.bfloat16().float())
    ids, mask = prompts(2, 7, seed=2, pad_rows={1: 2})
    new = 3 * WINDOW  # past the sliding window
    expected = reference_greedy(target, ids, mask, new)
    # a fixed tree of 8 branches: one tree shape (the planner's sampled plans follow each program's own
    # measured costs), and SSD's draft store in SD's capacity bucket: one compile per stage and shape
    options = dict(
        k=3, mode="ssd", lane="thread", fan_out="geometric", fan_out_budget=8, sd_when_faster=False
    )
    eager = saguaro.compile(target, draft, backend="eager", **options)
    compiled = saguaro.compile(target, draft, backend="inductor", **options)
    try:
        counters.clear()
        for mode in ("ar", "sd", "ssd"):
            want = eager.generate(ids, attention_mask=mask, max_new_tokens=new, mode=mode, eos_token_id=None)
            got = compiled.generate(
                ids, attention_mask=mask, max_new_tokens=new, mode=mode, eos_token_id=None
            )
            assert torch.equal(want.sequences, expected)
            assert torch.equal(got.sequences, want.sequences), f"inductor {mode} differs from eager"
        for mode in ("sd", "ssd"):  # the sampled stages too: same seed, same uniforms, same tokens
            want = eager.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                mode=mode,
                eos_token_id=None,
                temperature=1.0,
                seed=0,
            )
            got = compiled.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                mode=mode,
                eos_token_id=None,
                temperature=1.0,
                seed=0,
            )
            assert torch.equal(got.sequences, want.sequences), f"inductor sampled {mode} differs from eager"
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
        # the tokens above came from calls past dynamo too: every stage learnt a direct call (direct_call.py),
        # each calling Inductor's graph itself, past AOT autograd's wrapper
        for runner in (compiled.target, compiled.draft):
            for stage, fn in runner.built_stages.items():
                assert fn.direct_keys > 0 and fn.graph_keys == fn.direct_keys, stage.qualified
        assert counters["stats"]["unique_graphs"] >= 6  # the stages really went through dynamo
        # the verify's attention as the masked_attention kernel where it builds (attention "kernel": the family's
        # softcap takes the inline math inside it), else inline
        verify = compiled.target.stage(TARGET_VERIFY_ROUND).gm
        lowered = [n for n in verify.graph.nodes if n.op == "call_function" and n.target is attention_kernel]
        assert len(lowered) == 2 and all(n.args[8] == 1.0 for n in lowered)  # one per layer, the softcap kept
        assert not any(n.target in ATTENTION_OPS for n in verify.graph.nodes if n.op == "call_function")
        # the verify's linears as the packed kernel over narrow panels (pack_linears); the prefill's T rows too
        linears = [n for n in verify.graph.nodes if n.op == "call_function" and n.target is LINEAR]
        packed = [n for n in verify.graph.nodes if n.op == "call_function" and n.target is PACKED]
        prefill = compiled.target.stage(TARGET_PREFILL).gm
        assert (
            not linears and len(packed) == 4 * 2 + 1
        )  # q/k/v joined, o, gate/up joined, down a layer; the LM head
        assert not any(n.target is LINEAR for n in prefill.graph.nodes if n.op == "call_function")
        assert sum(1 for n in prefill.graph.nodes if n.target is PACKED) == len(packed)
        panels = {t.dtype for name, t in verify.named_buffers() if name.startswith(PANELS)}
        assert panels and panels <= {
            torch.float16,
            torch.bfloat16,
        }  # float16 first where a weight's values fit it
        # the round's (one row) on the packed kernel too; the round and the prefill share the verify's panels
        step = compiled.target.stage(TARGET_ROUND).gm
        assert not any(n.target is LINEAR for n in step.graph.nodes if n.op == "call_function")
        assert sum(1 for n in step.graph.nodes if n.target is PACKED) == len(packed)
        held = lambda gm: {t.data_ptr() for name, t in gm.named_buffers() if name.startswith(PANELS)}
        assert held(step) == held(verify) == held(prefill)
        # saguaro inspect kernels: each stage's compile time, generated code files and kernel names
        rows = saguaro.inspect(compiled).kernels("ssd", warm=False)
        assert [r["stage"] for r in rows] == [s.qualified for s in stages_for("ssd", 0.0)]
        for row in rows:
            assert row["compile_s"] > 0 and row["files"] and all(os.path.exists(f) for f in row["files"]), row
            assert row["kernel_count"] > 0 and all(
                k.startswith(("cpp_", "triton_")) for k in row["kernels"]
            ), row
        packed_rows = [
            r for r in rows if r["stage"] in (TARGET_VERIFY_ROUND.qualified, DRAFT_CHAIN.qualified)
        ]
        assert len(packed_rows) == 2  # SSD's verify and greedy drafting's chained step
        for (
            row
        ) in packed_rows:  # the packed kernel called from the C++ wrapper; Inductor's own kernels serial
            code = "".join(open(f).read() for f in row["files"])
            assert "saguaro_kernels::packed_linear" in code and "#pragma omp" not in code, row
        prefill_row = next(r for r in rows if r["stage"] == TARGET_PREFILL.qualified)
        code = "".join(
            open(f).read() for f in prefill_row["files"]
        )  # T rows: its own kernels keep their threads
        assert "saguaro_kernels::packed_linear" in code and "#pragma omp" in code
    finally:
        eager.close()
        compiled.close()
