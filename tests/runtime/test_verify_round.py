"""SD's and SSD's greedy verify and commit in one stage call (``target.verify_round_greedy``,
``tensor_math.verify_round``): its epilogue has the effect of the host's commit (verification, the append by
``SequenceBatch.append``, the next round's draft and verify inputs) and packs the outcome for the round's one
read; greedy SD and SSD call it once per round and give the target's own tokens, the same as by the verify
stage and the host's append; the builders that cannot offer it run the verify stage."""

import pytest
import torch

from saguaro.core.stages import ROUND_STAGES, TARGET_ROUND, TARGET_VERIFY, TARGET_VERIFY_ROUND, stages_for
from saguaro.runtime.base.sequences import SequenceBatch
from saguaro.tensor_math.verification import outcome_tokens, verify_greedy
from saguaro.tensor_math.verify_round import verify_round_greedy
from tests.conftest import tiny_program
from tests.models import EOS, PAD, prompts, reference_greedy

K, VOCAB = 3, 24


def sequences(seed: int) -> SequenceBatch:
    """Five rows: one left-padded, one finished by EOS, the others 3 to 6 tokens short of their budget."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 20, (5, 6), generator=gen)
    mask = torch.ones_like(ids)
    mask[2, :2] = 0
    seqs = SequenceBatch(
        ids, mask, max_new_tokens=7, capacity=6 + 7 + K + 2, eos_token_ids=[EOS, 7], pad_token_id=PAD
    )
    seqs.append(
        torch.tensor([[5, 6, 3, 3], [EOS, 9, 9, 9], [8, 8, 8, 8], [4, 4, 4, 4], [9, 3, 9, 9]]),
        torch.tensor([2, 1, 1, 4, 3]),
    )
    return seqs


@pytest.mark.parametrize("seed", range(6))
def test_round_epilogue_commits_as_the_host_does(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(5, K + 1, VOCAB, generator=gen)  # [B, K+1, V]
    logits[..., [EOS, 7]] = -99.0  # no EOS but the one below
    draft_tokens = logits[:, :K].argmax(dim=-1)  # [B, K]: accepted where not changed below
    draft_tokens[seed % 5, seed % K] = (draft_tokens[seed % 5, seed % K] + 1) % VOCAB  # one rejection
    logits[(seed + 1) % 5, seed % (K + 1), 7] = 99.0  # one row decides EOS id 7 (accepted or as r')
    draft_tokens[(seed + 1) % 5] = torch.where(
        torch.arange(K) == seed % (K + 1), 7, draft_tokens[(seed + 1) % 5]
    )
    host, graph = sequences(seed), sequences(seed)

    accepted, next_token = verify_greedy(
        logits, draft_tokens
    )  # the host's commit, then the next round's inputs
    host.append(outcome_tokens(draft_tokens, accepted, next_token), accepted + 1)
    want_accepted, want_next = host.read(accepted, next_token)
    draft_index, verify_index = host.tail_index(2), host.forward_index(K + 1)

    lengths, finished = graph.lengths.clone(), graph.finished.clone()
    outcome, new_lengths, new_finished, *inputs = verify_round_greedy(
        logits,
        draft_tokens,
        graph.tokens,
        graph.lengths,
        graph.finished,
        graph.padding,
        graph.eos_table(VOCAB),
        graph.end,
    )
    assert torch.equal(graph.lengths, lengths) and torch.equal(
        graph.finished, finished
    )  # read, never written
    assert torch.equal(graph.tokens, host.tokens)
    assert torch.equal(new_lengths, host.lengths) and torch.equal(new_finished, host.finished)
    graph.set_lengths_and_finished(new_lengths, new_finished, tuple(inputs))
    assert graph.read_outcome(outcome) == [want_accepted, want_next]  # the round's one read
    assert graph.host_lengths == host.host_lengths and graph.host_active == host.host_active
    expected = (
        host.gather(draft_index),
        draft_index,
        host.positions(draft_index),
        verify_index,
        host.positions(verify_index),
    )
    assert all(torch.equal(got, want) for got, want in zip(graph.next_inputs, expected))
    assert len(set(host.host_active)) == 2  # some rows finished (row 1 before), some did not (row 0 or 2)


def test_an_append_drops_the_round_inputs_made_for_the_old_lengths():
    seqs = sequences(0)
    seqs.set_lengths_and_finished(seqs.lengths.clone(), seqs.finished.clone(), ("inputs",))
    seqs.append_one(torch.tensor([3, 3, 3, 3, 3]))
    assert seqs.next_inputs is None


def calls_of(program, monkeypatch) -> list:
    """The target's stage calls from now on (the runner is shared with the other tests' programs: patched
    for this test only)."""
    runner, calls = program.target, []
    run = runner.run
    monkeypatch.setattr(
        runner, "run", lambda stage, *args, **kwargs: calls.append(stage) or run(stage, *args, **kwargs)
    )
    return calls


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_greedy_rounds_run_one_round_call_each_and_equal_the_verify_stage(mode, monkeypatch):
    options = dict(lane="thread", fan_out="geometric", sd_when_faster=False) if mode == "ssd" else {}
    target, _, program = tiny_program("llama", k=3, mode=mode, **options)
    ids, mask = prompts(3, 7, seed=4, pad_rows={1: 3})
    free = reference_greedy(target, ids, mask, 16)
    eos = int(free[0, 7 + 4])  # row 0 ends by EOS at its 5th new token at the latest
    expected = reference_greedy(target, ids, mask, 16, eos_token_id=eos)
    assert (
        stages_for(mode, 0.0)[1] is TARGET_VERIFY_ROUND and stages_for(mode, 1.0)[1] is TARGET_VERIFY.sampled
    )
    try:
        program.generate(
            ids, attention_mask=mask, max_new_tokens=16, eos_token_id=eos
        )  # SSD's calibration first
        calls = calls_of(program, monkeypatch)
        out = program.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=eos)
        assert torch.equal(out.sequences, expected)
        assert out.stats["mode"] == mode and out.stats["rounds"] >= 4
        assert calls[1:] == [TARGET_VERIFY_ROUND] * out.stats["rounds"]  # the prefill, then one call a round
        calls.clear()
        monkeypatch.setattr(
            program.target, "provides", lambda stage: stage not in ROUND_STAGES
        )  # a builder without it
        by_verify = program.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=eos)
        assert torch.equal(by_verify.sequences, expected)
        assert calls[1:] == [TARGET_VERIFY.greedy] * by_verify.stats["rounds"]
    finally:
        program.close()


def test_prepare_builds_what_a_builder_without_the_round_stages_runs(monkeypatch):
    _, _, program = tiny_program("llama", k=3, mode="sd")
    asked = []
    for runner in (program.target, program.draft):
        monkeypatch.setattr(runner, "stage", asked.append)
    program.prepare("sd", 0.0)
    assert TARGET_VERIFY_ROUND in asked and TARGET_VERIFY.greedy not in asked
    asked.clear()
    monkeypatch.setattr(program.target, "provides", lambda stage: stage not in ROUND_STAGES)
    program.prepare("sd", 0.0)
    assert TARGET_VERIFY.greedy in asked and TARGET_VERIFY_ROUND not in asked


def test_builders_under_cuda_graphs_run_sd_by_its_graphed_round_instead():
    """Under CUDA graphs SD's greedy round replays its draft steps and verify as one graph (``sd_graph.py``)
    and commits on the host: the verify-and-commit stage is not offered there (AR's round is)."""
    from saguaro.compile import CompiledStages

    builder = CompiledStages.__new__(CompiledStages)
    builder.cuda_graphs = True
    assert not builder.provides(TARGET_VERIFY_ROUND) and builder.provides(TARGET_VERIFY.greedy)
    assert builder.provides(TARGET_ROUND)
    builder.cuda_graphs = False
    assert builder.provides(TARGET_VERIFY_ROUND)


def test_the_round_graph_writes_the_tokens_never_lengths_or_finished():
    """A compiled kernel may run a one-element statement on every thread: the round's graph must not write
    what it reads back, so lengths and finished are outputs (``test_ar_round.py`` says why)."""
    from saguaro.lower.graph_inputs import mutated_inputs

    _, _, program = tiny_program("llama", k=3, mode="sd")
    gm = program.target.build.stage_graph(TARGET_VERIFY_ROUND)
    names = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    written = {names[i] for i in mutated_inputs(gm)}
    assert "tokens" in written
    assert not written & {"lengths", "finished", "padding", "eos_table", "end", "draft_tokens", "input_ids"}
