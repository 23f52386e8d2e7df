"""Inductor lowering: identical greedy tokens to eager for AR, SD and SSD (and identical sampled tokens
for SD and SSD with one seed), with zero graph breaks.

The one test of the suite that compiles (C++ on CPU); it is slow by nature, so it covers all three
modes on one tiny pair in one go.
"""

import os

import pytest
import torch
from torch._dynamo.utils import counters

import saguaro
from saguaro.core.stages import TARGET_VERIFY, stages_for
from saguaro.capture.attention_op import ATTENTION_OP
from saguaro.passes.lower_attention import attention_inline
from tests.models import prompts, reference_greedy, tiny_target, truncated_draft


@pytest.mark.heavy
@pytest.mark.timeout(600)  # 110-160 s with an empty Inductor cache on a 2-core CPU (C++ compiles)
def test_inductor_equals_eager_for_every_mode_without_graph_breaks():
    target = tiny_target("llama", seed=3)
    draft = truncated_draft(target)
    ids, mask = prompts(2, 7, seed=2, pad_rows={1: 2})
    expected = reference_greedy(target, ids, mask, 12)
    # a fixed tree: the planner's sampled plans follow each program's own measured costs; 8 branches keep
    # SSD's draft store (tree scratch included) in SD's capacity bucket: no second compile for it
    options = dict(k=3, mode="ssd", lane="thread", fan_out="geometric", fan_out_budget=8, sd_when_faster=False)
    eager = saguaro.compile(target, draft, backend="eager", **options)
    compiled = saguaro.compile(target, draft, backend="inductor", **options)
    counters.clear()
    for mode in ("ar", "sd", "ssd"):
        want = eager.generate(ids, attention_mask=mask, max_new_tokens=12, mode=mode, eos_token_id=None)
        got = compiled.generate(ids, attention_mask=mask, max_new_tokens=12, mode=mode, eos_token_id=None)
        assert torch.equal(want.sequences, expected)
        assert torch.equal(got.sequences, want.sequences), f"inductor {mode} differs from eager"
    for mode in ("sd", "ssd"):  # the sampled stages too: same seed, same uniforms, same tokens
        want = eager.generate(ids, attention_mask=mask, max_new_tokens=12, mode=mode, eos_token_id=None,
                              temperature=1.0, seed=0)
        got = compiled.generate(ids, attention_mask=mask, max_new_tokens=12, mode=mode, eos_token_id=None,
                                temperature=1.0, seed=0)
        assert torch.equal(got.sequences, want.sequences), f"inductor sampled {mode} differs from eager"
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 6  # the stages really went through dynamo
    verify = compiled.target.stage(TARGET_VERIFY.greedy).gm  # inductor compiles the attention math inline
    targets = [n.target for n in verify.graph.nodes if n.op == "call_function"]
    assert attention_inline in targets and ATTENTION_OP not in targets
    # saguaro inspect kernels: each stage's compile time, generated code files and kernel names
    rows = saguaro.inspect(compiled).kernels("ssd", warm=False)
    assert [r["stage"] for r in rows] == [s.qualified for s in stages_for("ssd", 0.0)]
    for row in rows:
        assert row["compile_s"] > 0 and row["files"] and all(os.path.exists(f) for f in row["files"]), row
        assert row["kernel_count"] > 0 and all(k.startswith(("cpp_", "triton_")) for k in row["kernels"]), row
    compiled.close()
