"""A row that joins a running batch where a row ended or left takes that row's place in place
(``BatchSession._replace``): one row copied, the other rows and the batch's tensors untouched. Each request
still gets exactly what ``program.generate`` gives it alone (greedy, and seeded sampled), and a joining row
that needs wider stores than the batch has rebuilds the batch instead."""

import pytest
import torch

from saguaro.runtime.batching import BatchSession
from tests.conftest import tiny_program
from tests.models import prompts
from tests.runtime.test_batch_session import solo


def addresses(session) -> tuple:
    state = session.state
    stores = [s for s in (state.target_store, state.draft_store) if s is not None]
    return (
        state.seqs.tokens.data_ptr(),
        *(s.k_caches[0].data_ptr() for s in stores),
        *(s.slot_pos.data_ptr() for s in stores),
    )


def run_until_done(session, tokens, rows, rounds=200):
    """Step until every row ended, adding each row's tokens to ``tokens[rows[row id]]``."""
    for _ in range(rounds):
        if not session.size:
            return
        for got in session.step():
            tokens[rows[got.row]] += got.new_tokens
    raise AssertionError("the session did not end")


@pytest.mark.parametrize("mode,temperature", [("ar", 0.0), ("sd", 0.0), ("sd", 0.9), ("ar", 0.9)])
def test_a_row_joining_where_one_ended_takes_its_place_in_place(mode, temperature):
    _, _, program = tiny_program("llama", mode=mode)
    ids, _ = prompts(4, 12, seed=31)
    seeds = [11, 12, 13, 14] if temperature > 0 else [None] * 4
    asks = [
        (ids[0, :9].tolist(), 3),
        (ids[1, :12].tolist(), 40),
        (ids[2, :5].tolist(), 30),
        (ids[3, :7].tolist(), 24),
    ]
    session = BatchSession(program, temperature=temperature)
    tokens, rows = {}, {}
    for i in range(3):
        first = session.join(asks[i][0], asks[i][1], seed=seeds[i])
        rows[first.row], tokens[i] = i, list(first.new_tokens)
    before = addresses(session)
    ended = False
    while not ended:  # request 0 (3 tokens) ends first, the others go on
        for got in session.step():
            tokens[rows[got.row]] += got.new_tokens
            ended |= got.finished and rows[got.row] == 0
    assert session.size == 2 and len(session.rows) == 3  # the ended row's place is held, for a joining row
    first = session.join(asks[3][0], asks[3][1], seed=seeds[3])
    rows[first.row], tokens[3] = 3, list(first.new_tokens)
    assert session.size == 3 and session.joined == 4 and session.left_early == 0
    assert addresses(session) == before  # taken in place: no batch rebuilt
    run_until_done(session, tokens, rows)
    for i, (prompt, budget) in enumerate(asks):
        assert tokens[i] == solo(program, prompt, budget, temperature, seeds[i]), i


@pytest.mark.parametrize("mode,temperature", [("ar", 0.0), ("sd", 0.0), ("sd", 0.9)])
def test_places_of_gone_rows_are_held_until_half_the_batch_is_gone(mode, temperature):
    """Rows that end with no row to take their places stop decoding where they are (the batch's tensors
    untouched); once half the batch is gone the running rows are copied into a narrower batch, once."""
    _, _, program = tiny_program("llama", mode=mode)
    ids, _ = prompts(4, 12, seed=34)
    seeds = [21, 22, 23, 24] if temperature > 0 else [None] * 4
    asks = [
        (ids[0, :9].tolist(), 2),
        (ids[1, :12].tolist(), 40),
        (ids[2, :5].tolist(), 24),
        (ids[3, :7].tolist(), 10),
    ]
    session = BatchSession(program, temperature=temperature)
    tokens, rows = {}, {}
    for i, (prompt, budget) in enumerate(asks):
        first = session.join(prompt, budget, seed=seeds[i])
        rows[first.row], tokens[i] = i, list(first.new_tokens)
    before = addresses(session)
    widths = []
    while session.size:
        for got in session.step():
            tokens[rows[got.row]] += got.new_tokens
        if session.state is not None:
            widths.append((session.size, len(session.rows), addresses(session) == before))
    assert (3, 4, True) in widths  # one row gone: its place held, nothing copied
    assert any(held < len(asks) and not same for _, held, same in widths)  # narrowed later, copied once
    for i, (prompt, budget) in enumerate(asks):
        assert tokens[i] == solo(program, prompt, budget, temperature, seeds[i]), i
    assert session.state is None and session.rows == []


def test_a_row_that_left_early_is_replaced_and_counted():
    _, _, program = tiny_program("llama", mode="sd")
    ids, _ = prompts(3, 10, seed=32)
    asks = [(ids[0, :6].tolist(), 30), (ids[1, :10].tolist(), 30), (ids[2, :4].tolist(), 20)]
    session = BatchSession(program)
    tokens, rows = {}, {}
    for i in range(2):
        first = session.join(*asks[i])
        rows[first.row], tokens[i] = i, list(first.new_tokens)
    for got in session.step():
        tokens[rows[got.row]] += got.new_tokens
    session.leave(next(r for r, i in rows.items() if i == 0))
    before = addresses(session)
    first = session.join(*asks[2])
    rows[first.row], tokens[2] = 2, list(first.new_tokens)
    assert addresses(session) == before and session.left_early == 1 and session.size == 2
    run_until_done(session, tokens, rows)
    want = solo(program, *asks[0])
    assert tokens[0] == want[: len(tokens[0])] and len(tokens[0]) < len(want)
    for i in (1, 2):
        assert tokens[i] == solo(program, *asks[i]), i


def test_a_row_needing_wider_stores_rebuilds_the_batch():
    _, _, program = tiny_program("llama", mode="sd")
    ids, _ = prompts(2, 12, seed=33)
    short, long = (ids[0, :4].tolist(), 2), (ids[1, :12].tolist(), 40)
    session = BatchSession(program)
    tokens, rows = {}, {}
    first = session.join(*short)
    rows[first.row], tokens[0] = 0, list(first.new_tokens)
    mate = session.join(short[0], 6)
    rows[mate.row], tokens[2] = 2, list(mate.new_tokens)
    narrow = session.state.target_store.capacity
    while session.size == 2 and not any(r.id in session._ended for r in session.rows):
        for got in session.step():
            tokens[rows[got.row]] += got.new_tokens
    first = session.join(*long)
    rows[first.row], tokens[1] = 1, list(first.new_tokens)
    assert session.state.target_store.capacity > narrow  # no place wide enough: the batch was rebuilt wider
    run_until_done(session, tokens, rows)
    assert tokens[0] == solo(program, *short) and tokens[1] == solo(program, *long)
    assert tokens[2] == solo(program, short[0], 6)


def test_put_row_copies_one_row_and_empties_its_slots_past_the_other_store():
    from saguaro.runtime.base.kv_store import KVStore

    _, _, program = tiny_program("llama", mode="sd")
    spec = program.target.spec
    batch, narrow = KVStore(spec, 3, 16), KVStore(spec, 1, 10)
    for t in (*batch.k_caches, *batch.v_caches):
        t.normal_()
    batch.slot_pos.copy_(torch.arange(16).expand(3, 16))
    batch.slot_branch.fill_(2)
    for t in (*narrow.k_caches, *narrow.v_caches):
        t.normal_()
    narrow.slot_pos[0, :7] = torch.arange(7)
    kept = [t.clone() for t in (*batch.k_caches, batch.slot_pos, batch.slot_branch)]
    batch.put_row(1, narrow)
    for mine, theirs in zip((*batch.k_caches, *batch.v_caches), (*narrow.k_caches, *narrow.v_caches)):
        assert torch.equal(mine[1, :, :10], theirs[0]) and not mine[1, :, 10:].any()
    assert batch.slot_pos[1].tolist() == list(range(7)) + [-1] * 9 and not batch.slot_branch[1].any()
    for before, after in zip(kept, (*batch.k_caches, batch.slot_pos, batch.slot_branch)):
        assert torch.equal(before[[0, 2]], after[[0, 2]])  # the other rows untouched
