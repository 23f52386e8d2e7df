"""linear_as_reduction: every linear of a graph as a product and a sum, equal to the linear up to
rounding; which stages get it (``linear_implementation``); and greedy decoding through it equal to the
target's own ``generate`` on every tested family (eager here; ``tests/lower/test_inductor.py`` runs it
compiled)."""

import pytest
import torch

import saguaro
from saguaro.core.config import SaguaroConfig
from saguaro.core.errors import ConfigError
from saguaro.core.stages import (
    FEW_ROW_FAMILIES,
    MULTI_ROW_FAMILIES,
    STAGES,
    TARGET_PREFILL,
    TARGET_SCORE,
    TARGET_STEP,
    TARGET_VERIFY,
)
from saguaro.lower.kernel_choice import linear_implementation
from saguaro.passes.base.graph_pass import LINEARS_AS_REDUCTIONS, record_of
from saguaro.passes.linear_as_reduction import LINEAR, LinearAsReduction
from saguaro.passes.pipeline import build_stage
from tests.models import (
    FAMILIES,
    family_draft,
    prompts,
    reference_greedy,
    tiny_family_target,
    tiny_target,
    truncated_draft,
)
from tests.passes.stage_helpers import base_graph, count


class Layers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 24)  # with a bias
        self.down = torch.nn.Linear(24, 16, bias=False)

    def forward(self, x):
        return torch.view_as_real(
            torch.view_as_complex(self.down(torch.relu(self.up(x))).unflatten(-1, (-1, 2)))
        )


@pytest.mark.parametrize("shape", [(16,), (3, 16), (2, 5, 16)])
def test_linears_become_a_product_and_a_sum_with_the_same_outputs(shape):
    model = Layers().eval()
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))  # [..., K]
    gm = torch.export.export(model, (x,)).run_decompositions({}).module()
    assert count(gm, LINEAR) == 2
    rewritten = LinearAsReduction()(gm)
    assert count(rewritten, LINEAR) == 0
    assert count(rewritten, torch.ops.aten.sum.dim_IntList) == 2
    assert LINEARS_AS_REDUCTIONS in record_of(rewritten).facts
    with torch.no_grad():
        want, got = model(x), rewritten(x)  # view_as_complex: the output is contiguous, as linear's
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_linear_of_unknown_rank_is_left_as_it_was(caplog):
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")  # no metadata: ranks unknown
    graph.output(graph.call_function(LINEAR, (x, w)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    with caplog.at_level("WARNING", logger="saguaro.passes.linear_as_reduction"):
        LinearAsReduction()(gm)
    assert count(gm, LINEAR) == 1
    assert "1 of 1 linears left as they were" in caplog.text


def test_the_few_row_stages_of_inductor_on_cpu_get_the_packed_kernel_by_default_and_this_pass_on_request():
    few = [s for s in STAGES if s.family in FEW_ROW_FAMILIES]
    assert {s.family for s in STAGES} - set(FEW_ROW_FAMILIES) == {"prefill", "score"} and few
    for requested in (
        "auto",
        "packed",
        "template",
        "reduction",
    ):  # a score's T rows: BLAS, whatever was asked
        assert linear_implementation("inductor", requested, "cpu", TARGET_SCORE.family) == "gemm"
    assert {s.family for s in few} - set(MULTI_ROW_FAMILIES)  # one-row stages are among them
    for stage in few:  # one row (step, round, chain) and several (verify, glue, tree) alike: pack_linears
        assert linear_implementation("inductor", "auto", "cpu", stage.family) == "packed"
        assert linear_implementation("eager", "packed", "cpu", stage.family) == "packed"
        assert linear_implementation("inductor", "auto", "cuda", stage.family) == "gemm"  # not measured there
        assert linear_implementation("eager", "auto", "cpu", stage.family) == "gemm"
        assert linear_implementation("eager", "reduction", "cpu", stage.family) == "reduction"
        assert linear_implementation("inductor", "gemm", "cpu", stage.family) == "gemm"
    # a prefill's T rows: the packed kernel (auto on Inductor/CPU, or asked) or a GEMM, never the reductions
    for requested in ("auto", "packed", "template"):
        assert linear_implementation("inductor", requested, "cpu", TARGET_PREFILL.family) == "packed"
    assert linear_implementation("eager", "packed", "cpu", TARGET_PREFILL.family) == "packed"
    for backend, requested, device in (
        ("inductor", "reduction", "cpu"),
        ("inductor", "gemm", "cpu"),
        ("eager", "auto", "cpu"),
        ("inductor", "auto", "cuda"),
    ):
        assert linear_implementation(backend, requested, device, TARGET_PREFILL.family) == "gemm"
    _, captured = base_graph()
    step = build_stage(captured.graph_module, TARGET_STEP, 8, "op", linears="reduction")
    verify = build_stage(captured.graph_module, TARGET_VERIFY.greedy, 8, "op")
    assert count(step, LINEAR) == 0 and record_of(step).ran[-1] == "linear_as_reduction"
    assert count(verify, LINEAR) == 15 and "linear_as_reduction" not in record_of(verify).ran


def test_template_takes_the_multi_row_stages_of_inductor_on_cpu_only():
    assert set(MULTI_ROW_FAMILIES) == set(FEW_ROW_FAMILIES) - {
        "step",
        "round",
        "chain",
    }  # one row: steps and rounds
    for stage in (s for s in STAGES if s.family in FEW_ROW_FAMILIES):
        template = linear_implementation("inductor", "template", "cpu", stage.family)
        # several rows per sequence: the GEMM template; a step's one row: the packed kernel, as "auto"
        assert template == ("template" if stage.family in MULTI_ROW_FAMILIES else "packed"), stage
        for backend, device in (("inductor", "cuda"), ("eager", "cpu")):  # elsewhere, as "auto"
            assert linear_implementation(backend, "template", device, stage.family) == linear_implementation(
                backend, "auto", device, stage.family
            ), (backend, device)


def test_linears_must_name_an_implementation_and_is_fixed_after_compile():
    with pytest.raises(
        ConfigError,
        match=r"linears='blas' is not allowed: choose one of auto, gemm, reduction, "
        r"packed, template",
    ):
        SaguaroConfig(linears="blas")
    program = saguaro.compile(tiny_target("llama"), mode="ar", backend="eager")
    with pytest.raises(ValueError, match=r"\['linears'\] cannot change after compile"):
        program.reconfigure(linears="gemm")


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", *FAMILIES])
def test_greedy_through_the_reductions_equals_generate(family):
    target = tiny_family_target(family) if family in FAMILIES else tiny_target(family)
    draft = family_draft(target) if family in FAMILIES else truncated_draft(target)
    ids, mask = prompts(2, 7, seed=2, pad_rows={1: 2})
    expected = reference_greedy(target, ids, mask, 12)
    program = saguaro.compile(
        target,
        draft,
        backend="eager",
        k=3,
        mode="ssd",
        linears="reduction",
        sd_when_faster=False,
        lane="thread",
    )
    try:
        for mode in ("ar", "ssd"):  # AR: the step; SSD: the step, verify, glue and tree
            out = program.generate(ids, attention_mask=mask, max_new_tokens=12, mode=mode, eos_token_id=None)
            assert torch.equal(out.sequences, expected), f"{family} {mode}"
        step = program.target.stage(TARGET_STEP)  # eager: the GraphModule itself
        assert count(getattr(step, "gm", step), LINEAR) == 0  # the reductions really ran
    finally:
        program.close()
