"""Continuous batching (``saguaro.runtime.batching.BatchSession``): rows that join a running batch at different
rounds, leave it early or end at their budget each get exactly what ``program.generate`` gives their request
alone: greedy token for token, and a seeded sampled request the same tokens whoever its batch mates are (mode
``ssd``: ``test_batch_session_ssd.py``)."""

import pytest
import torch

from saguaro.runtime.base.kv_store import KVPool
from saguaro.runtime.base.sequences import SequencePool
from saguaro.runtime.batching import BatchSession
from tests.conftest import tiny_program
from tests.models import prompts


def solo(program, prompt, max_new_tokens, temperature=0.0, seed=None, mode=None):
    """The new tokens ``generate`` gives ``prompt`` alone, up to and with the first EOS."""
    out = program.generate(
        torch.tensor([prompt]), max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, mode=mode
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    eos = {program.eos_token_id} if isinstance(program.eos_token_id, int) else set(program.eos_token_id or ())
    return next((tokens[: i + 1] for i, t in enumerate(tokens) if t in eos), tokens)


def drive(session, requests, leave_at=None):
    """Run ``requests`` = [(join at round, prompt, max_new_tokens, seed)] through ``session``; ``leave_at``:
    {request: round} to leave early. Returns each request's tokens and the batch size seen each round."""
    leave_at = leave_at or {}
    tokens, rows, ended, sizes, rnd = {}, {}, set(), [], 0
    while len(ended) < len(requests) or session.size:
        for i, (at, prompt, budget, seed) in enumerate(requests):
            if at == rnd:
                first = session.join(prompt, budget, seed=seed)
                rows[first.row], tokens[i] = i, list(first.new_tokens)
                if first.finished:
                    ended.add(i)
        for i, at in leave_at.items():
            if at == rnd and i not in ended:
                session.leave(next(r for r, j in rows.items() if j == i))
                ended.add(i)
        sizes.append(session.size)
        for got in session.step():
            i = rows[got.row]
            if i in leave_at and i in ended:
                raise AssertionError(f"request {i} got tokens after it left")
            tokens[i] += got.new_tokens
            if got.finished:
                ended.add(i)
        rnd += 1
        assert rnd < 500
    return tokens, sizes


@pytest.mark.parametrize("arch,mode", [("llama", "ar"), ("llama", "sd"), ("mistral", "sd"), ("qwen3", "sd")])
def test_greedy_rows_joining_and_leaving_equal_their_solo_output(arch, mode):
    _, _, program = tiny_program(arch, mode=mode)
    ids, _ = prompts(6, 12, seed=21)
    requests = [
        (0, ids[0, :5].tolist(), 30, None),
        (0, ids[1, :12].tolist(), 9, None),
        (2, ids[2, :3].tolist(), 20, None),
        (3, ids[3, :8].tolist(), 1, None),
        (5, ids[4, :11].tolist(), 25, None),
        (7, ids[5, :6].tolist(), 40, None),
    ]
    session = BatchSession(program)
    tokens, sizes = drive(session, requests, leave_at={5: 9})
    for i, (_, prompt, budget, _) in enumerate(requests):
        want = solo(program, prompt, budget)
        if i == 5:  # left after two rounds: what it got is the start of its solo output
            assert 1 < len(tokens[i]) < len(want) and tokens[i] == want[: len(tokens[i])]
        else:
            assert tokens[i] == want, i
    assert max(sizes) >= 3 and sizes[0] == 2  # rows did run together, and joined a running batch
    assert session.left_early == 1 and session.joined == 5  # the one-token request never joined the batch
    assert session.size == 0 and session.state is None


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_seeded_sampled_rows_get_their_solo_tokens_whoever_their_batch_mates(mode):
    _, _, program = tiny_program("llama", mode=mode)
    ids, _ = prompts(4, 10, seed=22)
    requests = [
        (0, ids[0, :6].tolist(), 24, 5),
        (1, ids[1, :10].tolist(), 18, 6),
        (1, ids[2, :4].tolist(), 20, 7),
        (4, ids[3, :9].tolist(), 16, 5),
    ]
    tokens, sizes = drive(BatchSession(program, temperature=0.9), requests)
    for i, (_, prompt, budget, seed) in enumerate(requests):
        assert tokens[i] == solo(program, prompt, budget, 0.9, seed), i
    assert max(sizes) >= 3
    assert tokens[0] != solo(program, requests[0][1], 24, 0.9, 6)  # the seed matters: the check can fail


def test_a_session_serves_between_generate_calls_and_refuses_what_it_cannot_run():
    _, _, program = tiny_program("llama", mode="sd")
    session = BatchSession(program)
    first = session.join([5, 6, 7], 6)
    assert not first.finished and session.size == 1
    assert solo(program, [9, 10], 4)  # generate between rounds: the session's rows are untouched
    got = first.new_tokens
    while session.size:
        got += sum((r.new_tokens for r in session.step()), [])
        assert (
            session.counters.rounds == 1 and len(session.counters.accepted_lengths) == 1
        )  # the last round's only
    assert got == solo(program, [5, 6, 7], 6)
    with pytest.raises(ValueError, match="mode='tree' is not allowed for a batch session"):
        BatchSession(program, mode="tree")
    with pytest.raises(ValueError, match="temperature"):
        BatchSession(program, temperature=-1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        session.join([5, 6], 0)
    assert session.step() == []


def test_a_batch_size_met_again_takes_back_its_pooled_tensors(monkeypatch):
    """The running batch's buffers and stores come from the runners' pools (which a program has with CUDA graphs,
    given here): the same addresses each time a batch size and capacity come back (a CUDA graph captured over
    them replays)."""
    _, _, program = tiny_program("llama", mode="sd")
    pool = KVPool()
    for runner in (program.target, program.draft):
        monkeypatch.setattr(runner, "kv_pool", pool)
    monkeypatch.setattr(program.target, "seq_pool", SequencePool())
    session = BatchSession(program)
    session.join([5, 6, 7, 8], 40)  # the longest: the batch's capacity throughout
    addresses = []
    for prompt in ([9, 10], [11, 12]):
        row = session.join(prompt, 8).row
        state = session.state
        addresses.append(
            (
                state.seqs.tokens.data_ptr(),
                state.target_store.k_caches[0].data_ptr(),
                state.draft_store.slot_pos.data_ptr(),
            )
        )
        del state
        session.step()
        session.leave(row)
        session.step()
        assert session.size == 1
    assert addresses[0] == addresses[1] and pool.reused > 0
