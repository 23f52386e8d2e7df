"""AR's greedy round in one stage call (``target.round_greedy``, ``tensor_math.ar_round``): its epilogue has
the effect of the host's round (the argmax appended by ``SequenceBatch.append_one``, the next query claimed
by ``KVStore.claim``); a greedy AR generation calls it once per token and gives the step's tokens; the
builders that cannot offer it (CUDA graphs, an artifact exported without it) run AR by the step."""

import pytest
import torch

import saguaro
from saguaro.core.stages import TARGET_ROUND, TARGET_STEP, stages_for
from saguaro.runtime.base.sequences import SequenceBatch
from saguaro.tensor_math.ar_round import round_greedy
from tests.models import EOS, PAD, prompts, reference_greedy, tiny_target


def sequences(seed: int) -> SequenceBatch:
    """Four rows, one left-padded, one finished, one a token short of its budget."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 20, (4, 6), generator=gen)
    mask = torch.ones_like(ids)
    mask[2, :2] = 0
    seqs = SequenceBatch(ids, mask, max_new_tokens=3, capacity=16, eos_token_ids=[EOS, 7], pad_token_id=PAD)
    seqs.append(torch.tensor([[5, 6], [EOS, 9], [8, 8], [4, 4]]), torch.tensor([2, 1, 1, 2]))
    return seqs


@pytest.mark.parametrize("seed", range(4))
def test_round_epilogue_appends_and_claims_as_the_host_round_does(seed):
    vocab = 24
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 1, vocab, generator=gen)
    logits[seed % 4, 0, 7] = 99.0  # one row draws EOS id 7
    host, graph = sequences(seed), sequences(seed)
    slot_pos = torch.randint(-1, 9, (4, 16), generator=gen)
    slot_branch = torch.randint(0, 3, (4, 16), generator=gen)
    host_pos, host_branch = slot_pos.clone(), slot_branch.clone()

    host.append_one(logits[:, -1].argmax(dim=-1))  # the host's round, then the next round's claim
    index = host.tail_index(1)
    host_pos.scatter_(1, index, host.positions(index))
    host_branch.scatter_(1, index, torch.zeros_like(index))

    lengths, finished = graph.lengths.clone(), graph.finished.clone()
    ids, positions, write_slots, new_lengths, new_finished, active = round_greedy(
        logits,
        slot_pos,
        slot_branch,
        graph.tokens,
        graph.lengths,
        graph.finished,
        graph.padding,
        graph.eos_table(vocab),
        graph.end,
    )
    assert torch.equal(graph.lengths, lengths) and torch.equal(
        graph.finished, finished
    )  # read, never written
    assert torch.equal(graph.tokens, host.tokens) and torch.equal(new_lengths, host.lengths)
    assert torch.equal(new_finished, host.finished)
    assert torch.equal(slot_pos, host_pos) and torch.equal(slot_branch, host_branch)
    assert torch.equal(write_slots, index) and torch.equal(positions, host.positions(index))
    assert torch.equal(ids, host.gather(index))
    assert int(active) == sum(host.host_active)
    assert int(active) < 4  # the finished row, and the row at its budget, stay finished


def test_eos_table_marks_the_eos_ids_within_the_vocabulary():
    seqs = SequenceBatch(
        torch.ones(1, 2, dtype=torch.long),
        torch.ones(1, 2, dtype=torch.long),
        4,
        8,
        eos_token_ids=[2, 5, 40],
        pad_token_id=0,
    )
    assert seqs.eos_table(8).nonzero().flatten().tolist() == [2, 5]


def test_greedy_ar_runs_one_round_call_per_token_and_equals_the_step():
    target = tiny_target("llama", logit_scale=4.0)
    ids, mask = prompts(3, 7, pad_rows={1: 3})
    program = saguaro.compile(target, None, mode="ar", backend="eager")
    assert stages_for("ar", 0.0)[-1] is TARGET_ROUND and stages_for("ar", 1.0)[-1] is TARGET_STEP
    runner, calls = program.target, []
    run = runner.run
    runner.run = lambda stage, *args, **kwargs: calls.append(stage) or run(stage, *args, **kwargs)
    out = program.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=EOS)
    expected = reference_greedy(target, ids, mask, 12, eos_token_id=EOS)
    assert torch.equal(out.sequences[:, : expected.shape[1]], expected)
    generated = (
        out.sequences.shape[1] - ids.shape[1]
    )  # the longest row's new tokens; the prefill gave the first
    assert calls[1:] == [TARGET_ROUND] * (generated - 1) and out.stats["rounds"] == generated - 1
    assert TARGET_STEP not in runner.built_stages
    calls.clear()
    runner.provides = lambda stage: stage is not TARGET_ROUND  # as a builder without it
    by_steps = program.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=EOS)
    assert torch.equal(by_steps.sequences, out.sequences)
    assert calls[1:] == [TARGET_STEP] * (generated - 1) and by_steps.stats["rounds"] == generated - 1


@pytest.mark.parametrize("round_stage", [True, False], ids=["round", "step"])
def test_ar_runs_one_round_past_an_eos_end_which_appends_nothing(round_stage):
    """The host reads the rows still active a round late: when every row ends by EOS, one more round is
    queued before the host knows; it runs on finished rows only, appends nothing and is not counted."""
    target = tiny_target("llama", logit_scale=4.0)
    ids, mask = prompts(3, 7, pad_rows={1: 3})
    T = ids.shape[1]
    free = reference_greedy(target, ids, mask, 12)
    eos = sorted(
        {int(free[b, T + 2 + b]) for b in range(3)}
    )  # row b ends by its (b+3)-th new token at the latest
    expected = reference_greedy(target, ids, mask, 12, eos_token_id=eos)
    program = saguaro.compile(target, None, mode="ar", backend="eager")
    runner, calls = program.target, []
    if not round_stage:
        runner.provides = lambda stage: stage is not TARGET_ROUND
    run = runner.run
    runner.run = lambda stage, *args, **kwargs: calls.append(stage) or run(stage, *args, **kwargs)
    out = program.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=eos)
    assert torch.equal(out.sequences, expected)
    generated = expected.shape[1] - T
    assert generated <= 5  # every row ended by EOS, long before its budget
    assert out.stats["rounds"] == generated - 1 and out.stats["new_tokens"] == int(
        (expected[:, T:] != PAD).sum()
    )
    assert calls[1:] == [TARGET_ROUND if round_stage else TARGET_STEP] * generated  # one past the end


def test_compiled_builders_offer_the_round_under_cuda_graphs_too():
    """The round's token buffer comes from the runner's SequencePool (fixed addresses), so under CUDA graphs
    it graphs like any stage (tests/lower/test_cuda_graph_generation.py runs it so)."""
    from saguaro.compile import CompiledStages
    from saguaro.runtime.base.model_runner import ModelRunner

    builder = CompiledStages.__new__(CompiledStages)
    runner = ModelRunner.__new__(ModelRunner)
    runner.build = builder
    for graphs in (True, False):
        builder.cuda_graphs = graphs
        assert runner.provides(TARGET_ROUND) and runner.provides(TARGET_STEP)


def test_the_round_graph_writes_the_tokens_and_slots_never_lengths_or_finished():
    """A compiled kernel may run a one-element statement on every thread: the round's graph must not write
    what it reads back (``lengths += 1`` raced at two threads), so lengths and finished are outputs."""
    from saguaro.lower.graph_inputs import mutated_inputs

    program = saguaro.compile(tiny_target("llama"), None, mode="ar", backend="eager")
    gm = program.target.build.stage_graph(TARGET_ROUND)
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    written = {names[i] for i in mutated_inputs(gm)}
    assert {"slot_pos", "slot_branch", "tokens"} <= written
    assert not written & {"lengths", "finished", "padding", "eos_table", "end", "input_ids", "positions"}
