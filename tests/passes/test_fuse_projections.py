"""fuse_projections: the linears that read one input joined into one (q/k/v, gate/up; Llama 4's router with its
shared expert's gate/up), on every tested family: which nodes were joined, how many linears are left, stage
outputs and caches bit-equal to the unjoined stage where the pass applies (the linears as reductions, eager
here, Inductor in the heavy test), greedy generations equal ``generate``; linears that cannot join are left
alone; one joined copy per weight group shared by every stage, narrow where ``narrow_weights`` would hold the
parts so; which stages get it (``fusion_applies``); and a tensor-parallel rank joins its own slices."""

import pytest
import torch

import saguaro
from saguaro.capture import capture
from saguaro.compile import CompiledStages
from saguaro.core.stages import DRAFT_GLUE, TARGET_PREFILL, TARGET_STEP, TARGET_VERIFY
from saguaro.passes import run_pipeline
from saguaro.passes.base.graph_pass import PROJECTIONS_FUSED, copy_graph, record_of
from saguaro.passes.base.graph_splice import PassError
from saguaro.passes.fuse_projections import ATTRIBUTE_PREFIX, LINEAR, FuseProjections, fusion_applies, groups
from saguaro.passes.linear_as_reduction import LinearAsReduction
from saguaro.passes.narrow_weights import ATTRIBUTE_PREFIX as NARROW_PREFIX
from saguaro.passes.pipeline import build_stage
from saguaro.passes.shard_tensor_parallel import Shard, ShardTensorParallel
from saguaro.runtime.base.kv_store import KVStore
from tests.models import (
    FAMILIES,
    family_draft,
    prompts,
    reference_greedy,
    tiny_family_target,
    tiny_target,
    truncated_draft,
)
from tests.passes.stage_helpers import call, count

ARCHS = ("llama", "qwen2", "qwen3", "mistral", *FAMILIES)
# per family: the joined groups of one layer, by projection (Llama 4: its router reads what its shared expert
# reads; GPT-OSS's experts are no aten.linear, its router reads alone)
JOINED = {
    "llama4": [("q_proj", "k_proj", "v_proj"), ("router", "gate_proj", "up_proj")],
    "gpt_oss": [("q_proj", "k_proj", "v_proj")],
}
LLAMA_LAYER = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")]


def model_of(arch: str, **kwargs):
    return tiny_family_target(arch, **kwargs) if arch in FAMILIES else tiny_target(arch, **kwargs)


def base_of(model):
    captured = capture(model)
    captured.graph_module = run_pipeline(captured.graph_module)
    return captured


def joined_buffers(gm) -> dict:
    return {name: t for name, t in gm.named_buffers() if name.startswith(ATTRIBUTE_PREFIX)}


def joined_reads(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "get_attr" and n.target.startswith(ATTRIBUTE_PREFIX)]


def run_stage(gm, spec, stage, seed=3):
    """Outputs and written caches of ``gm`` (target step or verify) on a fresh store."""
    gen = torch.Generator().manual_seed(seed)
    T = 1 if stage is TARGET_STEP else 4
    ids = torch.randint(3, 128, (2, T), generator=gen)
    index = torch.arange(5, 5 + T).expand(2, T).contiguous()
    extra = [] if stage is TARGET_STEP else [torch.randint(3, 128, (2, 3), generator=gen)]
    store = KVStore(spec, 2, 16)
    with torch.no_grad():
        out = call(gm, store, ids, index, *extra)
    return list(out) + [c.clone() for c in (*store.k_caches, *store.v_caches)]


@pytest.mark.parametrize("arch", ARCHS)
def test_each_family_joins_its_projections_and_the_reduction_stages_are_bit_equal(arch):
    captured = base_of(model_of(arch))
    base, layers = captured.graph_module, captured.spec.num_layers
    want = [tuple(g) for g in JOINED.get(arch, LLAMA_LAYER)] * layers
    found = [tuple(n.args[1].target.split(".")[-2] for n in g) for g in groups(base)]
    assert found == want
    plain = build_stage(base, TARGET_STEP, 8, "op")
    fused = build_stage(base, TARGET_STEP, 8, "op", fuse=True)
    assert count(fused, LINEAR) == count(plain, LINEAR) - sum(len(g) - 1 for g in want)
    assert record_of(fused).ran[-1] == "fuse_projections" and PROJECTIONS_FUSED in record_of(fused).facts
    buffers = joined_buffers(fused)
    assert len([name for name in buffers if not name.endswith("_bias")]) == len(want)
    for name, whole in buffers.items():  # each the parts' weights stacked (GPT-OSS, Qwen 2: biases too)
        group = next(
            g
            for g in groups(base)
            if name.startswith(ATTRIBUTE_PREFIX + g[0].args[1].target.replace(".", "_"))
        )
        index = 2 if name.endswith("_bias") else 1
        parts = [base.get_parameter(n.args[index].target) for n in group]
        assert torch.equal(whole, torch.cat(parts))
    assert any(name.endswith("_bias") for name in buffers) == (arch in ("qwen2", "gpt_oss"))
    for stage in (TARGET_STEP, TARGET_VERIFY.greedy):  # as reductions: every output and cache bit-equal
        want_out = run_stage(build_stage(base, stage, 8, "op", linears="reduction"), captured.spec, stage)
        got = build_stage(base, stage, 8, "op", linears="reduction", fuse=True)
        assert record_of(got).ran[-2:] == ("fuse_projections", "linear_as_reduction")
        assert all(torch.equal(a, b) for a, b in zip(run_stage(got, captured.spec, stage), want_out)), (
            arch,
            stage,
        )


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3", "llama4"])
def test_greedy_with_the_pass_equals_generate_and_sampling_is_unchanged(arch):
    target = model_of(arch)
    draft = family_draft(target) if arch in FAMILIES else truncated_draft(target)
    ids, mask = prompts(2, 7, seed=2, pad_rows={1: 2})
    expected = reference_greedy(target, ids, mask, 12)
    # a fixed tree of 8 branches: the planner's sampled plans would follow each program's measured costs
    options = dict(
        backend="eager",
        k=3,
        mode="ssd",
        linears="reduction",
        sd_when_faster=False,
        lane="thread",
        fan_out="geometric",
        fan_out_budget=8,
    )
    programs = [saguaro.compile(target, draft, **options) for _ in range(2)]
    for runner in (programs[0].target, programs[0].draft):
        runner.build.fuse_projections = (
            True  # the joined program (off on a CPU by default), before any stage is built
        )
    try:
        for mode in ("ar", "sd", "ssd"):  # the step; the verify and draft step; the glue and tree too
            out = programs[0].generate(
                ids, attention_mask=mask, max_new_tokens=12, mode=mode, eos_token_id=None
            )
            assert torch.equal(out.sequences, expected), f"{arch} {mode}"
        for mode in ("sd", "ssd"):  # the sampled stages: bit-equal stages draw the same tokens
            got, want = (
                p.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=12,
                    mode=mode,
                    eos_token_id=None,
                    temperature=1.0,
                    seed=0,
                )
                for p in programs
            )
            assert torch.equal(got.sequences, want.sequences), f"{arch} sampled {mode}"
        for stage in (TARGET_STEP, TARGET_VERIFY.greedy):  # eager: the GraphModule itself
            assert count(programs[0].target.stage(stage), LINEAR) == 0
            assert joined_reads(programs[0].target.stage(stage)) and not joined_reads(
                programs[1].target.stage(stage)
            )
        assert joined_reads(programs[0].draft.stage(DRAFT_GLUE))
    finally:
        for program in programs:
            program.close()


class Apart(torch.nn.Module):
    """Linears that must not join: a bias on one only (a, with_bias), a weight the graph computes (b and
    ``computed``), other inputs (a and b; wide)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 8, bias=False), torch.nn.Linear(16, 8, bias=False)
        self.with_bias, self.wide = torch.nn.Linear(16, 8), torch.nn.Linear(32, 8, bias=False)
        self.w = torch.nn.Parameter(torch.randn(8, 16))

    def forward(self, x, y, z):  # x [M, 16], y [M, 16], z [M, 32]
        computed = torch.nn.functional.linear(y, self.w * 2)  # beside b, on y: its weight is no held tensor
        return self.a(x), self.with_bias(x), self.b(y), computed, self.wide(z)


def test_linears_that_cannot_join_are_left_alone():
    x, y, z = torch.randn(3, 16), torch.randn(3, 16), torch.randn(3, 32)
    gm = torch.export.export(Apart().eval(), (x, y, z)).run_decompositions({}).module()
    assert count(gm, LINEAR) == 5 and groups(gm) == []
    with torch.no_grad():
        want = gm(x, y, z)
        fused = FuseProjections()(gm)
        got = fused(x, y, z)
    assert count(fused, LINEAR) == 5 and not joined_buffers(fused)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_one_joined_copy_shared_by_every_stage_and_a_new_one_after_an_in_place_change():
    captured = base_of(tiny_target("llama"))
    step = build_stage(captured.graph_module, TARGET_STEP, 8, "op", linears="reduction", fuse=True)
    verify = build_stage(captured.graph_module, TARGET_VERIFY.greedy, 8, "op", linears="reduction", fuse=True)
    shared = joined_buffers(step)
    assert shared and all(joined_buffers(verify)[name] is t for name, t in shared.items())
    q = captured.graph_module.get_parameter("model.model.layers.0.self_attn.q_proj.weight")
    with torch.no_grad():
        q.mul_(2)
    again = joined_buffers(build_stage(captured.graph_module, TARGET_STEP, 8, "op", fuse=True))
    name = ATTRIBUTE_PREFIX + "model_model_layers_0_self_attn_q_proj_weight"
    assert again[name] is not shared[name] and torch.equal(again[name][: q.shape[0]], q)
    assert torch.equal(shared[name][: q.shape[0]] * 2, q)  # the stage built before keeps the copy it took
    assert all(again[n] is t for n, t in shared.items() if n != name)


def test_with_narrow_weights_the_joined_copy_is_narrow_only_where_every_part_would_be():
    model = tiny_target(
        "llama", hidden=64
    )  # k and v [32, 64]: under narrow_weights' 4096 values, q [64, 64] not
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    captured = base_of(model)
    step = build_stage(
        captured.graph_module, TARGET_STEP, 8, "op", linears="reduction", narrow=True, fuse=True
    )
    dtypes = {name: t.dtype for name, t in joined_buffers(step).items()}
    assert dtypes == {
        ATTRIBUTE_PREFIX + f"model_model_layers_{i}_mlp_gate_proj_weight": torch.float16 for i in (0, 1)
    }
    # q/k/v would be held in float16 / float32 / float32 apart: left apart, as narrow_weights holds them
    assert count(step, torch.ops.aten.sum.dim_IntList) == 15 - 2  # one join per layer
    narrowed = {name for name, _ in step.named_buffers() if name.startswith(NARROW_PREFIX)}
    assert not any("gate_proj" in n or "up_proj" in n for n in narrowed) and any(
        "q_proj" in n for n in narrowed
    )
    plain = build_stage(captured.graph_module, TARGET_STEP, 8, "op", linears="reduction", narrow=True)
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            run_stage(step, captured.spec, TARGET_STEP), run_stage(plain, captured.spec, TARGET_STEP)
        )
    )


def test_it_must_run_before_linear_as_reduction():
    captured = base_of(tiny_target("llama"))
    gm = build_stage(captured.graph_module, TARGET_STEP, 8, "op", linears="reduction")
    with pytest.raises(
        PassError,
        match=r"^fuse_projections must run before linear_as_reduction, which leaves no "
        r"aten.linear to join \(passes before it: .*linear_as_reduction\)$",
    ):
        FuseProjections()(gm)
    assert LinearAsReduction.name in record_of(gm).ran


def test_where_the_pass_applies():
    for backend, device, linears in (("inductor", "cpu", "reduction"), ("eager", "cpu", "reduction")):
        assert fusion_applies(backend, device, linears, True)  # exact: where asked for
        assert not fusion_applies(backend, device, linears) and not fusion_applies(
            backend, device, linears, False
        )
    for backend in ("inductor", "eager"):  # a BLAS GEMM on a CPU: not exact, never
        assert not fusion_applies(backend, "cpu", "gemm", True) and not fusion_applies(backend, "cpu", "gemm")
    assert fusion_applies("inductor", "cuda", "gemm") and fusion_applies("inductor", "cuda", "reduction")
    assert not fusion_applies("inductor", "cuda", "gemm", False)
    assert not fusion_applies("eager", "cuda", "gemm") and not fusion_applies("eager", "cuda", "gemm", True)
    captured = base_of(tiny_target("llama"))

    def fused(backend, stage, device="cpu", **kwargs):
        builder = CompiledStages("target", captured.graph_module, 8, backend, "auto", device, **kwargs)
        return "fuse_projections" in record_of(builder.stage_graph(stage)).ran

    assert not fused("inductor", TARGET_STEP) and not fused(
        "inductor", TARGET_VERIFY.greedy
    )  # slower on a CPU
    assert fused("inductor", TARGET_STEP, linears="reduction", fuse_projections=True)
    assert fused("inductor", TARGET_VERIFY.greedy, linears="reduction", fuse_projections=True)
    for stage in (TARGET_STEP, TARGET_VERIFY.greedy):  # "auto" packs them: pack_linears joins, not this pass
        assert not fused("inductor", stage, fuse_projections=True)
    assert not fused("inductor", TARGET_PREFILL, fuse_projections=True)  # a BLAS GEMM
    assert not fused("inductor", TARGET_VERIFY.greedy, linears="template", fuse_projections=True)
    assert not fused("eager", TARGET_STEP, fuse_projections=True)
    assert fused("eager", TARGET_STEP, linears="reduction", fuse_projections=True)
    assert fused("inductor", TARGET_PREFILL, device="cuda") and fused("inductor", TARGET_STEP, device="cuda")


def test_a_tensor_parallel_rank_joins_its_own_slices():
    captured = base_of(tiny_target("qwen2"))  # q/k/v biases too
    rank = ShardTensorParallel(captured.spec, Shard(1, 2, "tp_test"))(copy_graph(captured.graph_module))
    gm = build_stage(rank, TARGET_STEP, 8, "op", linears="reduction", fuse=True)
    assert record_of(gm).ran[-3:] == ("lower_attention", "fuse_projections", "linear_as_reduction")
    layer = "model.model.layers.0."
    for projection, parts in (
        ("self_attn", ("q_proj", "k_proj", "v_proj")),
        ("mlp", ("gate_proj", "up_proj")),
    ):
        for kind in ("weight", "bias") if projection == "self_attn" else ("weight",):
            name = ATTRIBUTE_PREFIX + f"{layer}{projection}.{parts[0]}.weight".replace(".", "_")
            name += "_bias" if kind == "bias" else ""
            want = torch.cat([rank.get_parameter(f"{layer}{projection}.{p}.{kind}") for p in parts])
            assert torch.equal(joined_buffers(gm)[name], want), name  # the rank's slices, half the rows
            assert want.shape[0] * 2 == sum(
                captured.graph_module.get_parameter(f"{layer}{projection}.{p}.{kind}").shape[0] for p in parts
            )


@pytest.mark.heavy
@pytest.mark.timeout(900)  # four stage compiles: about a minute on an idle 2-core CPU with an empty cache
def test_inductor_stages_joined_are_bit_equal_to_the_unjoined_ones():
    model = tiny_target("llama", hidden=128)  # every projection of at least 4096 values: all held narrow
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())
    captured = base_of(model)
    for stage in (TARGET_STEP, TARGET_VERIFY.greedy):  # one row; K+1 rows
        results = []
        for fuse in (True, False):  # the linears as reductions (the verify's too), narrow_weights after
            builder = CompiledStages(
                "target",
                captured.graph_module,
                8,
                "inductor",
                "auto",
                "cpu",
                linears="reduction",
                fuse_projections=fuse,
            )
            graph = builder.stage_graph(stage)
            assert bool(joined_reads(graph)) == fuse
            assert all(t.dtype == torch.float16 for t in joined_buffers(graph).values())
            results.append(run_stage(builder(stage), captured.spec, stage))
        fused, plain = results
        assert all(torch.equal(a, b) for a, b in zip(fused, plain)), stage.qualified
