"""pack_linears and the packed few-row kernel: outputs equal bit for bit whether the panels hold the weights in
float32, float16 or bfloat16, vector or scalar loop, on each tested family; greedy SD and SSD through it equal
``generate``; which stages ``CompiledStages`` packs. Inductor calling the op inside compiled stages:
``tests/lower/test_inductor.py`` (its few-row stages are packed under the default settings)."""

import pytest
import torch

import saguaro
from saguaro.capture import capture
from saguaro.compile import CompiledStages
from saguaro.core.stages import (
    DRAFT_CHAIN,
    DRAFT_GLUE,
    DRAFT_STEP,
    DRAFT_TREE,
    TARGET_PREFILL,
    TARGET_ROUND,
    TARGET_VERIFY,
    TARGET_VERIFY_ROUND,
)
from saguaro.passes import run_pipeline
from saguaro.passes.base.graph_pass import LINEARS_PACKED, copy_graph, record_of
from saguaro.passes.pack_linears import ATTRIBUTE_PREFIX, PackLinears, panels
from saguaro.runtime.base.kv_store import KVStore
from saguaro.tensor_math import packed_linear as pl
from tests.models import (
    FAMILIES,
    family_draft,
    prompts,
    reference_greedy,
    tiny_family_target,
    tiny_target,
    truncated_draft,
)
from tests.passes.stage_helpers import call

PACKED = torch.ops.saguaro_kernels.packed_linear.default if pl.available() else None
pytestmark = pytest.mark.skipif(not pl.available(), reason="the packed kernel could not be built here")


ARCHS = ("llama", "qwen2", "qwen3", "mistral")  # tests.models.tiny_target's; FAMILIES: tiny_family_target's


@pytest.mark.parametrize(
    "rows, n, k",
    [
        (1, 48, 64),
        (1, 250, 70),
        (1, 1040, 24),
        (2, 97, 16),
        (2, 250, 70),
        (6, 384, 96),
        (7, 100, 33),
        (13, 17, 200),
        (32, 64, 40),
    ],
)
def test_the_kernel_gives_the_same_bits_from_any_panel_dtype_and_either_loop(rows, n, k):
    gen = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=gen)  # [M, K]
    half = torch.randn(n, k, generator=gen).half()  # [N, K]
    brain = (torch.randn(n, k, generator=gen) * 1e5).bfloat16()  # beyond float16's range
    for narrow in (half, brain):
        want = pl.packed_linear(x, pl.pack(narrow.float()), n)  # [M, N]
        assert want.shape == (rows, n) and want.dtype == torch.float32
        assert torch.equal(pl.packed_linear(x, pl.pack(narrow), n), want)
        assert torch.equal(torch.ops.saguaro_kernels.packed_linear_scalar(x, pl.pack(narrow), n), want)
        torch.testing.assert_close(
            want, x @ narrow.float().T, rtol=1e-5, atol=1e-4 * float(narrow.float().abs().max())
        )
    panels = pl.pack(half)
    with pytest.raises(RuntimeError, match="packed must be a contiguous"):  # the right shape, strided
        pl.packed_linear(x, torch.cat([panels, panels], 2)[..., : pl.PANEL], n)
    with pytest.raises(RuntimeError, match="panel tensor of x's K"):
        pl.packed_linear(x, panels[:, :-1].contiguous(), n)


def _rounded(model, dtype=torch.float16):
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).float())
    return model


@pytest.mark.parametrize("family", [*ARCHS, *FAMILIES])
def test_narrow_panels_give_the_float32_panels_bits_on_each_family(family):
    model = tiny_target(family, hidden=128) if family in ARCHS else tiny_family_target(family)
    _rounded(model)
    captured = capture(model)
    captured.graph_module = run_pipeline(captured.graph_module)
    results = []
    for narrow in (False, True):
        gm = PackLinears(narrow)(copy_graph(captured.graph_module))
        held = {name: t.dtype for name, t in gm.named_buffers() if name.startswith(ATTRIBUTE_PREFIX)}
        assert held and set(held.values()) == ({torch.float16} if narrow else {torch.float32})
        assert sum(1 for n in gm.graph.nodes if n.target is PACKED) >= len(held)
        assert LINEARS_PACKED in record_of(gm).facts
        ids = torch.randint(
            3, 128, (2, 6), generator=torch.Generator().manual_seed(2)
        )  # six rows: a verify's
        store = KVStore(captured.spec, 2, 16)
        with torch.no_grad():
            logits = call(gm, store, ids, torch.arange(6).expand(2, 6).contiguous())[0]
        results.append((logits, [c.clone() for c in store.k_caches + store.v_caches]))
    (want, want_kv), (got, got_kv) = results
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(got_kv, want_kv))
    with torch.no_grad():  # and the model's own (MKL's summation order: equal up to rounding)
        torch.testing.assert_close(want, model(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", [*ARCHS, *FAMILIES])
def test_linears_of_one_input_joined_into_one_call_give_the_same_bits_on_each_family(family):
    model = tiny_target(family, hidden=128) if family in ARCHS else tiny_family_target(family)
    captured = capture(_rounded(model))
    captured.graph_module = run_pipeline(captured.graph_module)
    apart, joined = (PackLinears(True, join)(copy_graph(captured.graph_module)) for join in (False, True))
    calls = [sum(1 for n in gm.graph.nodes if n.target is PACKED) for gm in (apart, joined)]
    assert calls[1] < calls[0]  # q / k / v (and gate / up where the MLP has them) in one call each
    assert any(name.startswith(ATTRIBUTE_PREFIX + "joined_") for name, _ in joined.named_buffers())
    for rows in (1, 6):  # a step's and a verify's
        ids = torch.randint(3, 128, (2, rows), generator=torch.Generator().manual_seed(rows))
        results = []
        for gm in (apart, joined):
            store = KVStore(captured.spec, 2, 16)
            with torch.no_grad():
                logits = call(gm, store, ids, torch.arange(rows).expand(2, rows).contiguous())[0]
            results.append((logits, [c.clone() for c in store.k_caches + store.v_caches]))
        (want, want_kv), (got, got_kv) = results
        assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(got_kv, want_kv)), rows


@pytest.mark.heavy
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_greedy_sd_and_ssd_through_packed_linears_equal_generate(family):
    if family == "llama":
        target = _rounded(tiny_target("llama", hidden=128, logit_scale=4.0))
        draft = truncated_draft(target)
    else:
        target = _rounded(tiny_family_target(family, logit_scale=4.0))
        draft = family_draft(target)
    ids, mask = prompts(2, 7)
    want = reference_greedy(target, ids, mask, 10)
    for mode in ("sd", "ssd"):
        program = saguaro.compile(target, draft, k=3, mode=mode, backend="eager", linears="packed")
        assert torch.equal(program.generate(ids, attention_mask=mask, max_new_tokens=10).sequences, want)
        program.close()


def test_panels_are_made_once_per_weight_and_version():
    weight = torch.randn(40, 64).half().float()
    first = panels(weight, True)
    assert first.dtype == torch.float16 and panels(weight, True) is first
    assert panels(weight, False).dtype == torch.float32
    with torch.no_grad():
        weight.add_(1 / 3)  # no longer float16 values: float32 panels
    assert panels(weight, True).dtype == torch.float32


def test_inductor_packs_every_few_row_stage_and_the_prefill_under_auto():
    model = _rounded(tiny_target("llama", hidden=128))
    captured = capture(model)
    captured.graph_module = run_pipeline(captured.graph_module)

    def packed(backend, stage, linears="auto", narrow=True):
        builder = CompiledStages(
            "target", captured.graph_module, 8, backend, "auto", "cpu", linears=linears, narrow_weights=narrow
        )
        gm = builder.stage_graph(stage)
        return {t.dtype for name, t in gm.named_buffers() if name.startswith(ATTRIBUTE_PREFIX)}

    for stage in (
        TARGET_VERIFY.greedy,
        TARGET_VERIFY_ROUND,
        TARGET_VERIFY.sampled,
        DRAFT_GLUE,
        DRAFT_TREE.greedy,
        TARGET_ROUND,
        DRAFT_STEP.greedy,
        DRAFT_CHAIN,
    ):  # several rows and one alike
        assert packed("inductor", stage) == {torch.float16}
    assert packed("inductor", TARGET_VERIFY.greedy, narrow=False) == {torch.float32}
    assert packed("inductor", TARGET_ROUND, linears="reduction") == set()  # on request: fused reductions
    assert packed("inductor", TARGET_PREFILL) == {
        torch.float16
    }  # a prefill's T rows too (not its kernels serial)
    assert not packed("inductor", TARGET_PREFILL, linears="reduction")  # there: BLAS
    assert not packed("inductor", TARGET_VERIFY.greedy, linears="template")
    assert not packed("eager", TARGET_VERIFY.greedy)  # eager keeps MKL unless asked
    assert packed("eager", TARGET_VERIFY.greedy, linears="packed") == {torch.float16}


def test_the_program_s_weights_are_reported_and_packed_stages_hold_only_their_panels():
    from saguaro.inspection import inspector as inspection
    from saguaro.inspection.weights import format_weights

    target = _rounded(tiny_target("llama", hidden=128))
    program = saguaro.compile(
        target, truncated_draft(target), k=3, mode="sd", backend="eager", linears="packed"
    )
    report = inspection.Inspector(program).weights(modes=("sd",))
    held = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in [*target.parameters(), *target.buffers()]
    }
    loaded = sum(held.values())  # the target's float32 weights (and RoPE's buffers), shared
    target_forms = report["models"]["target"]["by_form"]
    assert target_forms["as loaded"] == loaded  # held once, by the captured graph (the prefill reads them)
    linear_f32 = sum(m.weight.numel() * 4 for m in target.modules() if isinstance(m, torch.nn.Linear))
    panel_bytes = target_forms["panels"]
    assert linear_f32 / 2 <= panel_bytes < linear_f32  # float16 panels: half, padded to 64 columns
    assert report["total_bytes"] == sum(report["by_form"].values()) == sum(report["by_dtype"].values())
    assert report["by_dtype"]["float16"] >= panel_bytes
    verify = report["models"]["target"]["stages"][TARGET_VERIFY_ROUND.qualified]
    assert verify < loaded  # it holds its panels, not the float32 linears' weights
    gm = program.runner("target").built_stages[TARGET_VERIFY_ROUND]  # what SD runs
    read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    assert set(dict(gm.named_parameters())) | set(dict(gm.named_buffers())) <= read  # nothing held unread
    text = format_weights(report).splitlines()
    assert text[-1].split() == ["total", f"{report['total_bytes'] / 2**20:.2f}"]
    assert any(line.split()[:2] == ["target", "panels"] for line in text)
    program.close()


def test_every_finite_float16_and_bfloat16_value_widens_exactly_in_both_loops():
    bits = torch.arange(65536, dtype=torch.int32).to(torch.int16)  # every 16-bit pattern
    for dtype in (torch.float16, torch.bfloat16):
        values = bits.view(dtype)
        values = values[torch.isfinite(values.float())]
        weight = values[: values.numel() // 16 * 16].reshape(-1, 16)  # [N, 16]
        n, eye = weight.shape[0], torch.eye(16)  # one-hot rows: each output is one weight value
        for op in (torch.ops.saguaro_kernels.packed_linear, torch.ops.saguaro_kernels.packed_linear_scalar):
            assert torch.equal(op(eye, pl.pack(weight), n), weight.float().T)


def test_float32_panels_built_in_inference_mode_are_left_alone_by_narrow_weights():
    from saguaro.passes.narrow_weights import ATTRIBUTE_PREFIX as NARROW
    from saguaro.passes.pipeline import build_stage

    model = tiny_target("llama", hidden=128, seed=5)  # float32 values: no narrow dtype holds them
    captured = capture(model)
    captured.graph_module = run_pipeline(captured.graph_module)
    with torch.inference_mode():  # as a stage built on a generation's first round
        gm = build_stage(
            captured.graph_module,
            TARGET_VERIFY.greedy,
            8,
            "op",
            linears="packed",
            narrow=True,
            narrow_panels=True,
        )
    held = {name: t for name, t in gm.named_buffers()}
    assert {t.dtype for name, t in held.items() if name.startswith(ATTRIBUTE_PREFIX)} == {torch.float32}
    assert not any(name.startswith(NARROW + ATTRIBUTE_PREFIX) for name in held)
    assert record_of(gm).ran[-2:] == ("pack_linears", "narrow_weights")
