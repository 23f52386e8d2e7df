"""attention="auto" per stage: op for eager, inline (SDPA over the dense mask) for Inductor, and flex for
the tree stage of Inductor on CUDA behind FLEX_TREE_ON_CUDA, off until the GPU probe measures it."""

import pytest

from saguaro.core.stages import (
    DRAFT_GLUE,
    DRAFT_STEP,
    DRAFT_TREE,
    STAGES,
    TARGET_ROUND,
    TARGET_STEP,
    TARGET_VERIFY,
)
from saguaro.lower import kernel_choice
from saguaro.lower.kernel_choice import attention_implementation
from saguaro.passes.lower_attention import attention_flex, attention_inline
from saguaro.passes.pipeline import build_stage
from tests.passes.stage_helpers import base_graph, count

TREE = DRAFT_TREE.greedy.mask


def test_auto_keeps_todays_choice_everywhere():
    assert (
        kernel_choice.FLEX_TREE_ON_CUDA is False
    )  # the one-line switch, once benchmarks/gpu_probe.py measures it
    for stage in STAGES:
        for device in ("cpu", "cuda"):
            assert attention_implementation("eager", "auto", device, stage.mask) == "op"
            assert attention_implementation("inductor", "auto", device, stage.mask) == "inline"
    assert attention_implementation("eager") == "op" and attention_implementation("inductor") == "inline"


@pytest.mark.parametrize("requested", ["op", "inline", "flex"])
def test_an_explicit_choice_is_kept_for_every_stage(requested):
    for stage in STAGES:
        assert (
            attention_implementation("inductor", requested, "cuda", stage.mask, flex_tree=True) == requested
        )


def test_flex_tree_picks_flex_for_the_tree_stage_of_inductor_on_cuda_only(monkeypatch):
    assert attention_implementation("inductor", "auto", "cuda", TREE, flex_tree=True) == "flex"
    assert (
        attention_implementation("inductor", "auto", "cuda", TARGET_VERIFY.greedy.mask, flex_tree=True)
        == "inline"
    )
    assert attention_implementation("inductor", "auto", "cpu", TREE, flex_tree=True) == "inline"
    assert attention_implementation("eager", "auto", "cuda", TREE, flex_tree=True) == "op"
    assert (
        attention_implementation("inductor", "auto", "cuda", None, flex_tree=True) == "inline"
    )  # no stage named
    monkeypatch.setattr(kernel_choice, "FLEX_TREE_ON_CUDA", True)  # what flipping the switch does
    assert attention_implementation("inductor", "auto", "cuda", TREE) == "flex"
    assert attention_implementation("inductor", "auto", "cuda", TREE, flex_tree=False) == "inline"


def test_per_stage_choice_gives_flex_tree_graphs_and_inline_others():
    _, captured = base_graph()
    for stage in (DRAFT_TREE.greedy, DRAFT_TREE.sampled, DRAFT_GLUE, TARGET_VERIFY.greedy):
        attention = attention_implementation("inductor", "auto", "cuda", stage.mask, flex_tree=True)
        gm = build_stage(captured.graph_module, stage, 8, attention=attention)
        flex, inline = count(gm, attention_flex), count(gm, attention_inline)
        layers = captured.spec.num_layers
        assert (flex, inline) == ((layers, 0) if stage.mask == TREE else (0, layers)), stage.qualified


def test_auto_reduces_the_attention_of_ars_target_stages_on_cpu_only():
    """SDPA's CPU kernel spends a one-query call mostly in its BLAS set-up: AR's target stages compute the
    attention as Inductor's own reductions there; the draft's step, the verify and CUDA keep SDPA."""
    assert kernel_choice.REDUCED_ATTENTION == (TARGET_STEP, TARGET_ROUND)
    for stage in STAGES:
        want = "reduce" if stage in (TARGET_STEP, TARGET_ROUND) else "inline"
        assert attention_implementation("inductor", "auto", "cpu", stage.mask, stage=stage) == want, stage
        assert attention_implementation("inductor", "auto", "cuda", stage.mask, stage=stage) != "reduce"
        assert attention_implementation("eager", "auto", "cpu", stage.mask, stage=stage) == "op"
        assert attention_implementation("inductor", "inline", "cpu", stage.mask, stage=stage) == "inline"
    draft_step = DRAFT_STEP.greedy
    assert attention_implementation("inductor", "auto", "cpu", draft_step.mask, stage=draft_step) == "inline"


def test_reduce_requested_reduces_ars_target_stages_on_any_device_and_inlines_the_others():
    """``attention="reduce"``: what "auto" does on CPU, asked for anywhere (the GPU probe's row measures it
    against cuDNN's SDPA on CUDA); stages of several queries stay inline."""
    for stage in STAGES:
        want = "reduce" if stage in (TARGET_STEP, TARGET_ROUND) else "inline"
        for backend in ("inductor", "eager"):
            for device in ("cpu", "cuda"):
                assert attention_implementation(backend, "reduce", device, stage.mask, stage=stage) == want, (
                    stage
                )


def test_reduce_is_an_allowed_option_and_an_unknown_one_names_them_all():
    from saguaro.core.config import SaguaroConfig
    from saguaro.core.errors import ConfigError

    assert SaguaroConfig(attention="reduce").attention == "reduce"
    with pytest.raises(
        ConfigError, match="attention='reduced' is not allowed: choose one of auto, op, inline, flex, reduce"
    ):
        SaguaroConfig(attention="reduced")


def test_reduce_requested_on_eager_gives_generate_s_tokens():
    import saguaro
    from tests.models import prompts, reference_greedy, tiny_target, truncated_draft

    target = tiny_target("llama")
    program = saguaro.compile(target, truncated_draft(target), k=3, backend="eager", attention="reduce")
    ids, mask = prompts(2, 8, seed=3, pad_rows={1: 2})
    want = reference_greedy(target, ids, mask, 12)
    for mode in ("ar", "sd"):
        out = program.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=None, mode=mode)
        assert out.sequences.tolist() == want.tolist(), mode
