"""Mixed layer kinds, softcapping and sinks through the stage passes: the tree mask gives each branch
the shared prefix through each layer's own window (logits equal the HF forward of the branch's own
sequence), and the inline / flex lowerings give the op's results."""

import copy
import functools

import pytest
import torch

from saguaro.capture import capture
from saguaro.capture.attention_op import (
    ATTENTION_OP,
    MASK_OP,
    VARIANTS_OP,
    attention_kernel,
    attention_mask_kernel,
    attention_variants_kernel,
    direct_kernel_calls,
)
from saguaro.passes import run_pipeline
from saguaro.passes.lower_attention import attention_flex, attention_inline, flex_block_mask, lower_attention
from saguaro.passes.specialize_attention import specialize_attention
from saguaro.runtime.base.kv_store import KVStore
from tests.models import WINDOW, tiny_family_target

PROMPT = torch.tensor(
    [[5, 9, 17, 33, 41, 8, 100, 23, 61, 70], [7, 7, 3, 90, 12, 44, 19, 120, 6, 31]]
)  # [2, 10]
GLUE = torch.tensor([[12, 77, 3, 64], [8, 8, 100, 5]])  # r, x_1..x_3 at positions 10..13
BRANCHES = torch.tensor([[[40, 41], [50, 51]], [[60, 61], [70, 71]]])  # [B, branch, depth]
FORK_ROWS = (0, 2)  # branch 1 forks after glue row 0 (x_0 = r), branch 2 after row 2 (x_2)


@functools.cache
def base(family):
    model = tiny_family_target(family)
    captured = capture(model)
    return model, run_pipeline(captured.graph_module), captured.spec


def fresh(gm):
    return torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))


def count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


def call(gm, store, ids, slots, positions, branch=None, limit=None):
    branch = torch.zeros_like(slots) if branch is None else branch
    limit = positions if limit is None else limit
    store.claim(slots, positions, branch)
    return gm(
        ids,
        positions,
        slots,
        branch,
        limit,
        store.slot_pos,
        store.slot_branch,
        *store.k_caches,
        *store.v_caches,
    )[0]


def span(start, length, batch=2):
    return torch.arange(start, start + length).expand(batch, length).contiguous()


@torch.no_grad()
def tree_logits(family, implementation="op"):
    """Logits ``[B, 2 branches, 2 depths, V]`` of a two-branch, two-deep tree over prompt + glue, and the
    caches the stages wrote; ``implementation``: the ``lower_attention`` pass's, or ``"direct"``."""
    _, gm, spec = base(family)
    lowered = "op" if implementation == "direct" else implementation
    causal = lower_attention(specialize_attention(fresh(gm), "causal"), lowered)
    tree = lower_attention(specialize_attention(fresh(gm), "tree"), lowered)
    if implementation == "direct":  # the eager backend's graphs: the ops' kernels called directly
        causal, tree = direct_kernel_calls(causal), direct_kernel_calls(tree)
    store = KVStore(spec, 2, 24)
    call(causal, store, PROMPT, span(0, 10), span(0, 10))
    call(causal, store, GLUE, span(10, 4), span(10, 4))
    fork = torch.tensor(FORK_ROWS).expand(2, 2) + 10  # [B, branch]: position of the fork token
    branch_ids = torch.tensor([1, 2]).expand(2, 2).contiguous()
    out = []
    for depth in range(2):
        slots = span(14 + 2 * depth, 2)  # scratch slots after the glue, one per branch
        out.append(call(tree, store, BRANCHES[:, :, depth], slots, fork + 1 + depth, branch_ids, fork))
    return torch.stack(out, 2), [c.clone() for c in store.k_caches + store.v_caches]


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss", "llama4"])  # llama4: chunks, not windows
def test_tree_branches_see_the_prefix_through_each_layers_window(family):
    model, _, _ = base(family)
    got, _ = tree_logits(family)
    for b, row in enumerate(FORK_ROWS):
        sequence = torch.cat(
            [PROMPT, GLUE[:, : row + 1], BRANCHES[:, b]], 1
        )  # the branch as a plain sequence
        assert sequence.shape[1] > 3 * WINDOW
        with torch.no_grad():
            expected = model(sequence).logits[:, -2:]  # [B, depth, V]
        torch.testing.assert_close(got[:, b], expected, rtol=1e-4, atol=1e-5)


def test_specialized_masks_carry_their_kind_and_flex_builds_one_block_mask_per_kind():
    _, gm, _ = base("gemma3")
    assert count(gm, MASK_OP) == 2
    for kind in ("causal", "tree"):
        special = specialize_attention(fresh(gm), kind)
        kinds = {
            (n.args[6].meta["saguaro_mask"]["window"], n.args[6].meta["saguaro_mask"]["chunk"])
            for n in special.graph.nodes
            if n.op == "call_function" and n.target is ATTENTION_OP
        }
        assert kinds == {(WINDOW, 0), (0, 0)} and count(special, MASK_OP) == 0
        flex = lower_attention(special, "flex")
        assert count(flex, flex_block_mask) == 2 and count(flex, attention_flex) == 3
        windows = sorted(
            n.args[-2] for n in flex.graph.nodes if n.op == "call_function" and n.target is flex_block_mask
        )
        assert windows == [0, WINDOW]


@pytest.mark.parametrize("implementation", ["inline", "flex"])
@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])  # softcap; sinks
def test_lowerings_give_the_op_results_with_softcap_and_sinks(family, implementation):
    want, want_caches = tree_logits(family, "op")
    got, caches = tree_logits(family, implementation)
    _, gm, _ = base(family)
    lowered = lower_attention(specialize_attention(fresh(gm), "tree"), implementation)
    assert count(lowered, ATTENTION_OP) == 0 and count(lowered, VARIANTS_OP) == 0
    assert count(lowered, attention_inline if implementation == "inline" else attention_flex) == 2
    assert len(caches) == len(want_caches)
    if implementation == "inline":  # the op's own math: bit-identical
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(caches, want_caches))
    else:  # FlexAttention sums in another order
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        for a, b in zip(caches, want_caches):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])  # softcap (the variants op); windows (the plain op)
def test_direct_kernel_calls_give_the_ops_results_bit_for_bit(family):
    want, want_caches = tree_logits(family, "op")
    got, caches = tree_logits(family, "direct")
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(caches, want_caches))
    _, gm, _ = base(family)  # the base graph: one mask op per layer kind, one attention op per layer
    ops = {op: count(gm, op) for op in (MASK_OP, ATTENTION_OP, VARIANTS_OP)}
    direct = direct_kernel_calls(gm)
    kernels = {
        op: count(direct, kernel)
        for op, kernel in (
            (MASK_OP, attention_mask_kernel),
            (ATTENTION_OP, attention_kernel),
            (VARIANTS_OP, attention_variants_kernel),
        )
    }
    assert kernels == ops and sum(ops.values()) > 0
    assert {op: count(gm, op) for op in ops} == ops  # the graph given keeps its ops (inspector, exporter)
    assert all(count(direct, op) == 0 for op in ops)
    inline = lower_attention(specialize_attention(fresh(gm), "causal"), "inline")
    assert direct_kernel_calls(inline) is inline  # no op left: nothing to copy
