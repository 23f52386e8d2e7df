"""Greedy drafting by the chained step (``draft.chain_greedy``: the step's token and the next step's query, its slot
claimed in the store inside the graph) drafts the step's tokens and leaves the draft's store as the step by step
drafting does; the epilogue claims nothing past the store's last slot."""

from collections import Counter

import pytest
import torch

import saguaro
from saguaro.core.stages import DRAFT_CHAIN, DRAFT_STEP, stages_for
from saguaro.runtime.base.model_runner import ModelRunner
from saguaro.runtime.draft.decode import draft_decode
from saguaro.tensor_math.draft_chain import chain_greedy
from tests.models import prompts, reference_greedy, tiny_target, truncated_draft


def _drafted(runner, feed: int, chained: bool, k: int = 4):
    """Prefill two rows (the second left-padded by one), then draft ``k`` tokens feeding the last ``feed`` prompt
    tokens again; returns the tokens and the store."""
    if not chained:
        runner.provides = lambda stage: stage is not DRAFT_CHAIN  # as a builder without it
    ids = torch.tensor([[5, 9, 14, 3, 7, 11], [1, 8, 2, 6, 12, 4]])  # [2, 6]
    padding = torch.tensor([0, 1])
    store = runner.new_store(2, 16)
    index = torch.arange(6).expand(2, 6).clone()  # [2, 6]: slots
    positions = (index - padding[:, None]).clamp_min(0)
    runner(store, ids[:, : 6 - feed], positions[:, : 6 - feed], index[:, : 6 - feed])  # the prefill's KV
    tokens, probs = draft_decode(
        runner, store, ids[:, -feed:], index[:, -feed:], positions[:, -feed:], k, 0.0, None
    )
    runner.__dict__.pop("provides", None)
    assert probs is None
    return tokens, store


@pytest.mark.parametrize(
    "feed, together",
    [(1, True), (2, True), (2, False)],
    ids=["one token", "two tokens in one call", "two tokens, a catch-up call first"],
)
def test_chained_drafting_equals_the_steps_and_leaves_the_same_store(feed, together, monkeypatch):
    from saguaro.runtime.draft import decode

    if not together:  # as where the draft's linears are Inductor's reductions
        monkeypatch.setattr(decode, "feeds_together", lambda draft, stage: False)
    target = tiny_target("llama")
    program = saguaro.compile(target, truncated_draft(target, layers=2), k=4, mode="sd", backend="eager")
    runner = program.draft
    assert runner.provides(DRAFT_CHAIN) and DRAFT_CHAIN in stages_for("sd", 0.0)
    assert decode.feeds_together(runner, DRAFT_CHAIN) is together  # eager: BLAS linears, two rows for one
    chained, chained_store = _drafted(runner, feed, chained=True)
    stepped, stepped_store = _drafted(runner, feed, chained=False)
    assert torch.equal(chained, stepped)
    assert DRAFT_CHAIN in runner.built_stages and DRAFT_STEP.greedy in runner.built_stages
    # the same slots hold the same tokens' KV: nothing claimed past the last written slot (x_k's is dropped)
    assert torch.equal(chained_store.slot_pos, stepped_store.slot_pos)
    assert torch.equal(chained_store.slot_branch, stepped_store.slot_branch)
    valid = stepped_store.slot_pos >= 0  # [B, S]
    assert int(valid[0].sum()) == 6 + 4 - 1  # the prompt and x_1..x_{k-1}
    for ours, theirs in zip(
        (*chained_store.k_caches, *chained_store.v_caches), (*stepped_store.k_caches, *stepped_store.v_caches)
    ):
        assert torch.equal(ours.transpose(1, 2)[valid], theirs.transpose(1, 2)[valid])
    program.close()


def test_the_epilogue_claims_the_next_slot_and_nothing_past_the_store():
    logits = torch.zeros(2, 1, 5)
    logits[0, 0, 3], logits[1, 0, 1] = 1.0, 2.0  # [B, 1, V]
    slot_pos = torch.full((2, 4), -1)
    slot_branch = torch.full((2, 4), 7)
    positions, write_slots = torch.tensor([[1], [2]]), torch.tensor([[1], [3]])  # row 1 wrote the last slot
    token, ids, next_positions, next_slots = chain_greedy(
        logits, positions, write_slots, slot_pos, slot_branch
    )
    assert token.tolist() == [3, 1] and ids.tolist() == [[3], [1]]
    assert next_positions.tolist() == [[2], [3]] and next_slots.tolist() == [[2], [4]]
    assert slot_pos.tolist() == [
        [-1, -1, 2, -1],
        [-1, -1, -1, -1],
    ]  # row 0's slot 2 claimed; row 1 past the end
    assert slot_branch.tolist() == [[7, 7, 0, 7], [7, 7, 7, 7]]


def test_compiled_chained_steps_after_the_first_reuse_its_inputs_and_stay_exact(monkeypatch):
    from saguaro.lower import repeated_call

    target = tiny_target("llama")
    ids, mask = prompts(2, 7, seed=4, pad_rows={1: 2})
    expected = reference_greedy(target, ids, mask, 16)
    program = saguaro.compile(
        target, truncated_draft(target, layers=2), k=3, mode="sd", backend="inductor", compile="blocking"
    )
    served = []
    original = repeated_call.RepeatedCall.__call__

    def counted(self, *changed):
        out = original(self, *changed)
        served.append(out is not None)
        return out

    monkeypatch.setattr(repeated_call.RepeatedCall, "__call__", counted)
    run, by_run = ModelRunner.run, []

    def run_counted(runner, stage, store, input_ids, *args, **kwargs):
        by_run.append((stage, input_ids.shape[1]))
        return run(runner, stage, store, input_ids, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "run", run_counted)
    try:
        chain_runs = []  # per generation: {query width: chained calls that went through run}
        for _ in range(2):  # the first generation compiles; the second's chained calls go the repeated way
            by_run.clear()
            out = program.generate(ids, attention_mask=mask, max_new_tokens=16, mode="sd", eos_token_id=None)
            assert torch.equal(out.sequences, expected)
            chain_runs.append(Counter(width for stage, width in by_run if stage is DRAFT_CHAIN))
        assert served and all(served)  # every later call of a chain reused the first's inputs
        # and the later rounds' first calls too (ModelRunner.kept_query_call: the same store's tensors): one call
        # of each query width ran (a round's first call feeds 2 tokens, or 1, in one call: feeds_together)
        assert (
            out.stats["rounds"] > 2
            and set(chain_runs[1]) <= {1, 2}
            and max(chain_runs[1].values(), default=0) <= 1
        )
        assert 2 in chain_runs[0]  # the first round fed its two tokens in one call
        stage = program.draft.stage(DRAFT_CHAIN)
        # the repeated calls are counted as the stage's
        assert stage.calls == len(served) + sum(sum(runs.values()) for runs in chain_runs)
        assert program.draft.stage_cost_s[DRAFT_CHAIN.qualified] > 0
    finally:
        program.close()


def test_a_repeated_call_puts_in_the_changed_arguments_and_refuses_another_layout():
    from types import SimpleNamespace

    from saguaro.lower.repeated_call import RepeatedCall

    def boxed(inputs):  # as Inductor's graph function: it frees the list it is given
        out = [inputs[0] * 10 + inputs[1]]
        inputs.clear()
        return out

    # inputs: argument 0 (changes) and argument 2 (fixed); argument 1 unread
    direct = SimpleNamespace(
        boxed=boxed,
        _arguments=[(0, 0), (1, 2)],
        boxed_inputs=lambda args: [args[0], args[2]],
        applies=lambda: True,
    )
    calls = []
    fixed = torch.tensor([[1], [2]])
    repeat = RepeatedCall(
        direct, (torch.zeros(2, 1, dtype=torch.long), None, fixed), 1, lambda: calls.append(1)
    )
    (out,) = repeat(torch.tensor([[3], [4]]))
    assert out.tolist() == [[31], [42]]
    (out,) = repeat(torch.tensor([[5], [6]]))  # the inputs again, though the last call cleared its list
    assert out.tolist() == [[51], [62]] and len(calls) == 2
    assert repeat(torch.zeros(2, 2, dtype=torch.long)) is None  # another shape
    assert repeat(torch.zeros(1, 2, dtype=torch.long).t()) is None  # the shape, other strides
    assert len(calls) == 2


def test_fed_tokens_go_together_where_the_linears_read_each_weight_once_for_every_row():
    from types import SimpleNamespace

    from saguaro.runtime.draft.decode import feeds_together

    def runner(linears):
        return SimpleNamespace(build=SimpleNamespace(linears_of=lambda stage: linears))

    assert feeds_together(runner("packed"), DRAFT_CHAIN) and feeds_together(runner("gemm"), DRAFT_CHAIN)
    assert not feeds_together(runner("reduction"), DRAFT_CHAIN)  # two rows read each weight twice there
    assert not feeds_together(SimpleNamespace(build=object()), DRAFT_CHAIN)  # a builder that does not say


def test_sampled_drafting_hands_the_step_freshly_strided_inputs(monkeypatch):
    # a compiled stage guards on strides: SD's one-token feed (a column of its [B, 2] inputs) must not compile
    # the sampled step again beside the layout its later steps give it
    target = tiny_target("llama")
    program = saguaro.compile(target, truncated_draft(target, layers=2), k=3, mode="sd", backend="eager")
    runner = program.draft
    run, layouts = runner.run, []

    def recorded(stage, store, *args, **kwargs):
        layouts.extend(
            (a.shape, a.stride(), a.contiguous().stride()) for a in args[:3]
        )  # ids, positions, slots
        return run(stage, store, *args, **kwargs)

    monkeypatch.setattr(runner, "run", recorded)
    ids = torch.tensor([[5, 9, 14, 3, 7, 11], [1, 8, 2, 6, 12, 4]])  # [2, 6]
    store = runner.new_store(2, 16)
    index = torch.arange(6).expand(2, 6).clone()  # [2, 6]: slots, positions alike
    runner(store, ids[:, :4], index[:, :4], index[:, :4])  # the prefill's KV
    feed = ids[:, 4:], index[:, 4:], index[:, 4:]  # [2, 2] of the round's inputs ...
    tokens, probs = draft_decode(
        runner, store, *(t[:, 1:] for t in feed), 3, 0.8, torch.Generator().manual_seed(0)
    )
    assert tokens.shape == (2, 3) and probs.shape == (2, 3, target.config.vocab_size)
    assert len(layouts) == 3 * 3  # ... fed one token: three sampled steps
    strayed = [(tuple(shape), stride) for shape, stride, fresh in layouts if stride != fresh]
    assert not strayed, f"inputs of the sampled step not freshly strided: {strayed}"
