"""last_row_head: where a stage reads only the last row's logits (prefill, the draft's steps), the LM head runs over
that row alone and gives its logits bit for bit (with the packed kernel, which computes each row alone; up to
rounding with BLAS), on each tested family (a final softcap, a logit scale between head and logits); stages
that read every row, and heads whose output something else reads, are left as they were."""

import operator

import pytest
import torch

from saguaro.capture import capture
from saguaro.core.stages import DRAFT_CHAIN, DRAFT_STEP, DRAFT_TREE, TARGET_PREFILL, TARGET_VERIFY
from saguaro.passes import run_pipeline
from saguaro.passes.base.graph_pass import HEAD_LAST_ROW, copy_graph, record_of
from saguaro.passes.last_row_head import END, last_row_head
from saguaro.passes.pack_linears import PackLinears
from saguaro.passes.pipeline import build_stage
from saguaro.passes.splice_epilogue import LOGITS_NODE
from saguaro.runtime.base.kv_store import KVStore
from saguaro.tensor_math import packed_linear as pl
from tests.models import FAMILIES, tiny_family_target, tiny_target
from tests.passes.stage_helpers import call

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
SLICE = torch.ops.aten.slice.Tensor


def _sliced(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is SLICE and tuple(n.args[1:]) == (1, -1, END))


def _captured(family):
    model = tiny_target(family, hidden=128) if family in ARCHS else tiny_family_target(family)
    captured = capture(model)
    captured.graph_module = run_pipeline(captured.graph_module)
    return model, captured


@pytest.mark.skipif(not pl.available(), reason="the packed kernel could not be built here")
@pytest.mark.parametrize("family", [*ARCHS, *FAMILIES])
def test_the_prefill_s_head_reads_the_last_row_and_gives_its_logits_bit_for_bit(family):
    model, captured = _captured(family)
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(3))  # [B, T]
    positions = torch.arange(7).expand(2, 7).contiguous()
    results = []
    for gm in (
        PackLinears(False)(copy_graph(captured.graph_module)),  # every row's logits [B, T, V]
        build_stage(captured.graph_module, TARGET_PREFILL, 8, "op", linears="packed"),
    ):  # the last's [B, V]
        store = KVStore(captured.spec, 2, 16)
        with torch.no_grad():
            logits = call(gm, store, ids, positions)[0]
        results.append((logits, [c.clone() for c in store.k_caches + store.v_caches]))
    (every_row, want_kv), (last, got_kv) = results
    assert every_row.dim() == 3 and last.shape == every_row[:, -1].shape
    assert torch.equal(last, every_row[:, -1]) and all(torch.equal(a, b) for a, b in zip(got_kv, want_kv))
    gemm = build_stage(captured.graph_module, TARGET_PREFILL, 8, "op")  # BLAS: equal up to rounding
    assert _sliced(gemm) == 1 and HEAD_LAST_ROW in record_of(gemm).facts
    with torch.no_grad():
        torch.testing.assert_close(
            call(gemm, KVStore(captured.spec, 2, 16), ids, positions)[0],
            model(ids).logits[:, -1],
            rtol=1e-4,
            atol=1e-4,
        )


def test_only_the_stages_that_read_the_last_row_alone_are_trimmed():
    _, captured = _captured("llama")
    for stage in (TARGET_PREFILL, DRAFT_CHAIN, DRAFT_STEP.greedy, DRAFT_STEP.sampled):
        assert _sliced(build_stage(captured.graph_module, stage, 8, "op")) == 1, stage
    for stage in (TARGET_VERIFY.greedy, TARGET_VERIFY.sampled, DRAFT_TREE.greedy):  # every row's logits read
        gm = build_stage(captured.graph_module, stage, 8, "op")
        assert _sliced(gm) == 0 and "last_row_head" in record_of(gm).ran, stage


def _spliced_graph(extra_reader: bool, between=None):
    """x [B, T, H] -> linear -> (``between``) -> logits; read as logits[:, -1] (and, with ``extra_reader``, the
    head's output read whole too)."""
    graph = torch.fx.Graph()
    x, weight = graph.placeholder("x"), graph.placeholder("weight")
    x.meta["val"] = torch.empty(2, 5, 4)
    head = graph.call_function(torch.ops.aten.linear.default, (x, weight))
    head.meta["val"] = torch.empty(2, 5, 3)
    logits = graph.call_function(between, (head, 2.0)) if between is not None else head
    logits.meta[LOGITS_NODE] = True
    last = graph.call_function(operator.getitem, (logits, (slice(None), -1)))
    graph.output((last, head) if extra_reader else (last,))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_a_head_read_otherwise_is_left_alone_and_a_scaled_one_is_trimmed():
    x, weight = torch.randn(2, 5, 4), torch.randn(3, 4)
    # add: not among the operations it walks through
    for extra_reader, between, trimmed in (
        (False, None, True),
        (True, None, False),
        (False, torch.ops.aten.mul.Tensor, True),
        (False, torch.ops.aten.add.Tensor, False),
    ):
        gm = _spliced_graph(extra_reader, between)
        want = gm(x, weight)
        gm = last_row_head(gm)
        assert (_sliced(gm) == 1) is trimmed, (extra_reader, between)
        got = gm(x, weight)
        assert all(torch.allclose(a, b) for a, b in zip(got, want))
