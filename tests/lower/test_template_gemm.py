"""``linears="template"``: SD's verify compiled with Inductor's freezing and its C++ GEMM template.

The verify (several rows per sequence) keeps its GEMMs and compiles under
:data:`~saguaro.lower.lowering.TEMPLATE_GEMM_CONFIG`; the step (one row) keeps the reductions of
``linear_as_reduction``; the prefill its plain GEMMs. Greedy tokens equal the target's ``generate``.
"""

import pytest
import torch

import saguaro
from saguaro.core.stages import TARGET_PREFILL, TARGET_STEP, TARGET_VERIFY_ROUND
from saguaro.lower.lowering import TEMPLATE_GEMM_CONFIG
from saguaro.passes.linear_as_reduction import LINEAR
from tests.models import prompts, reference_greedy, tiny_target, truncated_draft


def _frozen_gemm_calls(stage) -> int:
    """Kernels or calls in the stage's generated code that only freezing's packed weights produce: the
    template's micro-kernels, or ATen's packed MKL GEMM where autotuning found that faster."""
    code = "".join(open(record["file"]).read() for record in stage.output_code)
    return code.count("micro_gemm") + code.count("_mkl_linear")


@pytest.mark.heavy
@pytest.mark.timeout(600)  # about a minute with an empty Inductor cache (the template's autotuning)
def test_the_verify_runs_the_gemm_template_and_greedy_equals_generate():
    target = tiny_target("llama")
    draft = truncated_draft(target)
    ids, mask = prompts(2, 7, seed=2, pad_rows={1: 2})
    expected = reference_greedy(target, ids, mask, 12)
    program = saguaro.compile(
        target, draft, backend="inductor", k=3, mode="sd", linears="template", compile="blocking"
    )
    try:
        for mode in ("sd", "ar"):
            out = program.generate(ids, attention_mask=mask, max_new_tokens=12, mode=mode, eos_token_id=None)
            assert torch.equal(out.sequences, expected), mode
        verify = program.target.stage(TARGET_VERIFY_ROUND)  # what SD runs
        step = program.target.stage(TARGET_STEP)
        prefill = program.target.stage(TARGET_PREFILL)
        assert (
            verify.config_patch == TEMPLATE_GEMM_CONFIG and not step.config_patch and not prefill.config_patch
        )
        linears = lambda stage: sum(n.target is LINEAR for n in stage.gm.graph.nodes)
        assert linears(verify) > 0 and linears(step) == 0  # the verify's GEMMs kept, the step's reduced
        assert _frozen_gemm_calls(verify) > 0 and _frozen_gemm_calls(step) == 0
        assert _frozen_gemm_calls(prefill) == 0
    finally:
        program.close()
