"""Stage passes: which nodes each rewrote, node counts, and results equal to the graph before it
followed by the runtime's own (eager) math."""

import copy

import pytest
import torch

from saguaro.capture.attention_op import ATTENTION_OP, MASK_OP
from saguaro.core.stages import DRAFT_GLUE, DRAFT_STEP, DRAFT_TREE, STAGES, TARGET_PREFILL, TARGET_VERIFY
from saguaro.passes.pipeline import build_stage
from saguaro.passes.specialize_attention import specialize_attention
from saguaro.passes.splice_epilogue import splice_epilogue
from saguaro.tensor_math import sampling, verification
from saguaro.tensor_math.fork import branch_layout, fork_with_ranks
from tests.passes.stage_helpers import base_graph, call, count, prefilled_store

PROMPT = torch.tensor([[5, 9, 17, 33, 41], [7, 7, 3, 90, 12]])
SPEC = torch.tensor([[12, 77, 3, 64], [8, 8, 100, 5]])  # r, x_1..x_3 per row


def fresh(gm):
    return torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))


def spec_index():
    return torch.arange(5, 9).expand(2, 4).contiguous()


def test_flat_signature_and_one_attention_node_per_layer():
    _, captured = base_graph()
    gm = captured.graph_module
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    assert names[:7] == [
        "input_ids",
        "positions",
        "write_slots",
        "query_branch",
        "query_limit",
        "slot_pos",
        "slot_branch",
    ]
    assert count(gm, ATTENTION_OP) == 2 and count(gm, MASK_OP) == 1


@pytest.mark.parametrize("kind", ["causal", "tree"])
def test_specialize_attention_rewrites_the_mask_node_and_keeps_results(kind):
    """The specialised graph's logits over ``[r, x_1..x_3]`` (all on the shared branch) equal the HF
    model's own forward over prompt + speculation: an oracle that shares no mask code with Saguaro."""
    model, captured = base_graph()
    before = fresh(captured.graph_module)
    after = specialize_attention(fresh(captured.graph_module), kind)
    assert count(before, MASK_OP) == 1 and count(after, MASK_OP) == 0
    assert count(after, ATTENTION_OP) == 2
    used = {n.name for n in after.graph.nodes if n.op == "placeholder" and n.users}
    if kind == "causal":  # causal stages never read query branches or limits
        assert "query_branch" not in used and "query_limit" not in used
    else:
        assert {"query_branch", "query_limit"} <= used
    store = prefilled_store(captured.spec, PROMPT)
    logits = call(after, store, SPEC, spec_index())[0]  # [2, 4, V]
    with torch.no_grad():
        expected = model(torch.cat([PROMPT, SPEC], 1)).logits[:, PROMPT.shape[1] :]  # [2, 4, V]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)


# The branch picture of the tree tests: prompt in slots 0..4, glue r x_1 x_2 x_3 in slots 5..8
# (positions 5..8); branch 1 forks at glue row 0 (after r), branch 2 at glue row 2 (after x_2).
FORK_ROWS = (0, 2)
TREE_TOKENS = torch.tensor([[40, 41], [50, 51]])  # [B, 2]: the branches' first tree tokens c


def dense_tree_mask(depth: int) -> torch.Tensor:
    """The tree mask of depth ``depth`` (1 or 2) written out by hand from the picture: ``[2 queries, 13
    slots]``. Branch β sees the prompt, the glue up to its fork row, and its own tree slots (depth-1
    slots 9 and 10, depth-2 slots 11 and 12)."""
    rows = []
    for beta, j in enumerate(FORK_ROWS):
        visible = list(range(0, 5 + j + 1)) + [9 + beta] + ([11 + beta] if depth == 2 else [])
        rows.append([slot in visible for slot in range(13)])
    return torch.tensor(rows)


def test_tree_mask_equals_the_dense_mask_drawn_by_hand():
    from saguaro.capture.attention_op import tree_bias

    _, captured = base_graph()
    store = prefilled_store(captured.spec, PROMPT)
    call(captured.graph_module, store, SPEC, spec_index())  # the glue
    fork = torch.tensor([[5 + j for j in FORK_ROWS]] * 2)  # [B, 2]: positions of the fork tokens
    branch = torch.tensor([[1, 2], [1, 2]])
    for depth in (1, 2):
        slots = torch.tensor([[9, 10], [9, 10]]) + 2 * (depth - 1)  # [B, 2]
        store.claim(slots, fork + depth, branch)
        bias = tree_bias(
            slots, fork + depth, branch, fork, store.slot_pos, store.slot_branch, 0, 1, torch.float32
        )  # [B, 1, 2, S]
        allowed = bias[:, 0, :, :13] == 0  # [B, 2, 13]
        for b in range(2):
            assert torch.equal(allowed[b], dense_tree_mask(depth)), f"row {b}, depth {depth}"
        assert bool((bias[:, 0, :, 13:] == float("-inf")).all())  # nothing beyond the tree slots


def test_tree_stage_equals_the_model_on_each_branch_sequence():
    """Each branch's next token from the tree stage equals the HF model's greedy choice after that
    branch's own sequence (prompt, glue up to the fork, the branch's token)."""
    model, captured = base_graph()
    tree = build_stage(captured.graph_module, DRAFT_TREE.greedy, 8)
    store = prefilled_store(captured.spec, PROMPT)
    call(captured.graph_module, store, SPEC, spec_index())  # the glue: r, x_1..x_3 in slots 5..8
    fork = torch.tensor([[5 + j for j in FORK_ROWS]] * 2)
    branch = torch.tensor([[1, 2], [1, 2]])
    (tokens,) = call(
        tree, store, TREE_TOKENS, fork + 1, branch=branch, limit=fork, slots=torch.tensor([[9, 10], [9, 10]])
    )
    for b in range(2):
        for beta, j in enumerate(FORK_ROWS):
            sequence = torch.cat([PROMPT[b], SPEC[b, : j + 1], TREE_TOKENS[b, beta : beta + 1]])[None]
            with torch.no_grad():
                expected = model(sequence).logits[0, -1].argmax()
            assert int(tokens[b, beta]) == int(expected), f"row {b}, branch {beta + 1}"


def test_splice_verification_outputs_accepted_and_next_only():
    model, captured = base_graph()
    gm = splice_epilogue(specialize_attention(fresh(captured.graph_module), "causal"), TARGET_VERIFY.greedy)
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    assert len(out_node.args[0]) == 2
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"][-1] == "draft_tokens"
    store = prefilled_store(captured.spec, PROMPT)
    accepted, nxt = call(gm, store, SPEC, spec_index(), SPEC[:, 1:])
    with torch.no_grad():
        logits = model(torch.cat([PROMPT, SPEC], 1)).logits[:, 5:]
    exp_acc, exp_next = verification.verify_greedy(logits, SPEC[:, 1:])
    assert torch.equal(accepted, exp_acc) and torch.equal(nxt, exp_next)


def test_splice_verification_sampled_equals_eager_function():
    model, captured = base_graph()
    gm = build_stage(captured.graph_module, TARGET_VERIFY.sampled, 8)
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(2, 3, 128, generator=gen), -1)
    accept_u, resample_u = verification.verification_uniforms(2, 3, gen, "cpu")
    inv_t = torch.tensor(1.0)
    store = prefilled_store(captured.spec, PROMPT)
    got = call(gm, store, SPEC, spec_index(), SPEC[:, 1:], probs, inv_t, accept_u, resample_u)
    with torch.no_grad():
        logits = model(torch.cat([PROMPT, SPEC], 1)).logits[:, 5:]
    expected = verification.verify_sampled(logits, SPEC[:, 1:], probs, inv_t, accept_u, resample_u)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_splice_fork_returns_candidates_and_ranked_rows():
    model, captured = base_graph()
    gm = splice_epilogue(specialize_attention(fresh(captured.graph_module), "causal"), DRAFT_GLUE, 8)
    rows, ranks = branch_layout([2, 1, 0, 3])
    store = prefilled_store(captured.spec, PROMPT)
    candidates, ranked = call(gm, store, SPEC, spec_index(), SPEC[:, 1:], rows, ranks)
    assert candidates.shape == (2, 6) and ranked.shape == (2, 4, 8)
    with torch.no_grad():
        logits = model(torch.cat([PROMPT, SPEC], 1)).logits[:, 5:]
    exp_c, exp_r = fork_with_ranks(logits, SPEC[:, 1:], rows, ranks, 8)
    assert torch.equal(candidates, exp_c) and torch.equal(ranked, exp_r)
    for b in range(2):  # the speculated token x_{j+1} is never a candidate of row j
        for i, j in enumerate(rows.tolist()):
            if j < 3:
                assert int(candidates[b, i]) != int(SPEC[b, j + 1])


STAGE_OF_EPILOGUE = {
    "last": TARGET_PREFILL,
    "step_greedy": DRAFT_STEP.greedy,
    "step_sampled": DRAFT_STEP.sampled,
}


@pytest.mark.parametrize("epilogue", ["last", "step_greedy", "step_sampled"])
def test_splice_sampling_epilogues_equal_eager_functions(epilogue):
    model, captured = base_graph()
    gm = splice_epilogue(
        specialize_attention(fresh(captured.graph_module), "causal"), STAGE_OF_EPILOGUE[epilogue]
    )
    store = prefilled_store(captured.spec, PROMPT)
    extra = (torch.tensor(1.25), torch.tensor([0.3, 0.9])) if epilogue == "step_sampled" else ()
    got = call(gm, store, SPEC, spec_index(), *extra)
    with torch.no_grad():
        logits = model(torch.cat([PROMPT, SPEC], 1)).logits[:, 5:]
    fn = {
        "last": sampling.last_logits,
        "step_greedy": sampling.step_greedy,
        "step_sampled": sampling.step_sampled,
    }[epilogue]
    expected = fn(logits, *extra)
    expected = expected if isinstance(expected, tuple) else (expected,)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_every_stage_builds_and_keeps_its_kv_writes():
    _, captured = base_graph()
    for stage in STAGES:
        gm = build_stage(captured.graph_module, stage, 8)
        assert count(gm, ATTENTION_OP) == 2, f"{stage.qualified} lost an attention node (its KV writes)"
        assert count(gm, MASK_OP) == 0


def test_a_stage_graphs_code_is_generated_once_after_its_last_pass(monkeypatch):
    model, captured = base_graph()
    generated = []  # the graph of each python_code call
    real = torch.fx.Graph.python_code
    monkeypatch.setattr(
        torch.fx.Graph,
        "python_code",
        lambda self, *args, **kwargs: (generated.append(self), real(self, *args, **kwargs))[1],
    )
    gm = build_stage(captured.graph_module, TARGET_VERIFY.greedy, 8, attention="inline")
    assert sum(graph is gm.graph for graph in generated) == 1  # three passes rewrote it; its code came once
    store = prefilled_store(captured.spec, PROMPT)
    before = len(generated)
    accepted, nxt = call(gm, store, SPEC, spec_index(), SPEC[:, 1:])
    assert len(generated) == before  # returned with its code ready: the call generated none
    with torch.no_grad():
        logits = model(torch.cat([PROMPT, SPEC], 1)).logits[:, 5:]
    exp_acc, exp_next = verification.verify_greedy(logits, SPEC[:, 1:])
    assert torch.equal(accepted, exp_acc) and torch.equal(nxt, exp_next)


def test_pass_failures_name_the_fx_node():
    from saguaro.passes.base.graph_splice import PassError

    _, captured = base_graph()
    gm = build_stage(captured.graph_module, TARGET_VERIFY.greedy, 8)
    with pytest.raises(PassError, match="FX node 'output'.*only the logits"):
        splice_epilogue(gm, TARGET_VERIFY.greedy)  # its epilogue is already spliced
    with pytest.raises(PassError, match="no saguaro::attention_mask node"):
        specialize_attention(gm, "causal")
