"""Continuous batching in mode ``ssd`` (``BatchSession(mode="ssd")``, ``runtime/batching_ssd.py``): rows join the
draft lane's running batch at different rounds (``join_rows``) and leave it early or at their budget
(``keep_rows``), on a thread lane and a process lane, and each greedy row gets exactly what ``program.generate``
gives its prompt alone; a lane that fails mid-session leaves the rows to SD, exactly, and the session goes on."""

import pytest
import torch

from saguaro.runtime.batching import BatchSession
from saguaro.runtime.draft import tree
from tests.conftest import tiny_program
from tests.models import prompts
from tests.runtime.test_batch_session import drive, solo
from tests.runtime.test_lane_failure import failing_after


def requests_of(seed: int) -> list:
    ids, _ = prompts(5, 12, seed=seed)
    return [
        (0, ids[0, :5].tolist(), 24, None),
        (0, ids[1, :12].tolist(), 9, None),
        (2, ids[2, :3].tolist(), 18, None),
        (3, ids[3, :8].tolist(), 1, None),
        (4, ids[4, :11].tolist(), 20, None),
    ]


def check_solo(program, requests, tokens, left=()):
    for i, (_, prompt, budget, _) in enumerate(requests):
        want = solo(program, prompt, budget)
        if i in left:  # what a row that left got is the start of its solo output
            assert 1 < len(tokens[i]) < len(want) and tokens[i] == want[: len(tokens[i])], i
        else:
            assert tokens[i] == want, i


@pytest.mark.parametrize("lane", ["thread", "process"])
def test_ssd_rows_joining_and_leaving_equal_their_solo_output(lane):
    _, _, program = tiny_program("llama", mode="ssd", lane=lane, sd_when_faster=False)
    try:
        requests = requests_of(31)
        session = BatchSession(program)
        tokens, sizes = drive(session, requests, leave_at={0: 5})
        assert session.run == "ssd" and session.lanes_failed == 0, session.why
        assert program.lanes.started().kind == lane
        assert max(sizes) >= 3 and sizes[0] == 2
        assert session.left_early == 1 and session.joined == 4 and session.size == 0
        assert session.ssd.lane is None and program.lanes.started().holder is None  # the lane was let go
        check_solo(program, requests, tokens, left={0})
    finally:
        program.close()


def test_a_lane_that_fails_mid_session_leaves_the_rows_to_sd_exactly(monkeypatch):
    _, _, program = tiny_program("llama", k=3, mode="ssd", lane="thread", sd_when_faster=False)
    try:
        requests = requests_of(32)
        for _, prompt, budget, _ in requests:  # the solo outputs (and the lane's warm-up) before the failure
            solo(program, prompt, budget)
        monkeypatch.setattr(tree, "build_speculations", failing_after(3, RuntimeError("draft device lost")))
        session = BatchSession(program)
        with pytest.warns(RuntimeWarning, match="draft device lost.*SD"):
            tokens, _ = drive(session, requests)
        assert session.lanes_failed == 1 and session.run == "sd" and program.lanes.failed_lanes == 1
        monkeypatch.undo()
        check_solo(program, requests, tokens)
        again, _ = drive(session, requests[:2])  # an empty session plans afresh: a new lane, SSD again
        assert session.run == "ssd" and again == {i: tokens[i] for i in range(2)}
    finally:
        program.close()


def test_a_generate_call_between_rounds_takes_the_lane_and_the_rows_go_on_with_sd():
    _, _, program = tiny_program("llama", mode="ssd", lane="thread", sd_when_faster=False)
    try:
        session = BatchSession(program)
        got = session.join([5, 6, 7], 12).new_tokens
        got += session.step()[0].new_tokens
        assert session.run == "ssd"
        other = solo(program, [9, 10, 11, 12], 6)  # opens the lane's server for itself
        while session.size:
            got += sum((r.new_tokens for r in session.step()), [])
        assert session.run == "sd" and session.lanes_failed == 0
        assert got == solo(program, [5, 6, 7], 12) and other == solo(program, [9, 10, 11, 12], 6)
        with pytest.raises(ValueError, match="seed"):
            BatchSession(program, temperature=0.8).join([5, 6], 4, seed=3)
    finally:
        program.close()


def test_unseeded_sampled_rows_run_ssd_rounds_together():
    """Sampled rows without a seed share the lane's batch: each verifies its own proposal distribution (the
    joined rows' ``probs`` concatenated onto the batch's), draws from its own generator on the target's side,
    and ends at its budget or EOS."""
    _, _, program = tiny_program("llama", mode="ssd", lane="thread", sd_when_faster=False)
    torch.manual_seed(
        33
    )  # unseeded rows draw their seeds from torch's generator: as it stands after earlier tests,
    # rows could end early enough that never three ran together
    try:
        session = BatchSession(program, temperature=0.8)
        requests = requests_of(33)
        tokens, sizes = drive(session, requests, leave_at={0: 5})
        assert session.run == "ssd" and session.lanes_failed == 0 and max(sizes) >= 3, session.why
        vocab, eos = program.target.spec.vocab_size, program.eos_token_id
        for i, (_, _, budget, _) in enumerate(requests):
            assert 1 <= len(tokens[i]) <= budget and all(0 <= t < vocab for t in tokens[i]), i
            assert i == 0 or len(tokens[i]) == budget or tokens[i][-1] == eos, i
    finally:
        program.close()


def test_a_draft_process_killed_mid_session_leaves_the_rows_to_sd_exactly():
    _, _, program = tiny_program(
        "llama", k=3, mode="ssd", lane="process", sd_when_faster=False, lane_timeout_s=30
    )
    try:
        requests = requests_of(34)[:3]
        wanted = [
            solo(program, prompt, budget) for _, prompt, budget, _ in requests
        ]  # and the lane's warm-up
        session = BatchSession(program)
        got = {}
        for _i, (_, prompt, budget, _) in enumerate(requests[:2]):
            first = session.join(prompt, budget)
            got[first.row] = list(first.new_tokens)
        for _ in range(2):
            for r in session.step():
                got[r.row] += r.new_tokens
        assert session.run == "ssd"
        process = program.lanes.started().lane.process
        process.kill()
        process.wait()
        with pytest.warns(RuntimeWarning, match="dead.*SD"):
            for r in session.step():
                got[r.row] += r.new_tokens
        assert session.run == "sd" and session.lanes_failed == 1 and program.lanes.started() is None
        first = session.join(requests[2][1], requests[2][2])  # a row joins the batch that SD now runs
        got[first.row] = list(first.new_tokens)
        while session.size:
            for r in session.step():
                got[r.row] += r.new_tokens
        assert [got[row] for row in sorted(got)] == wanted
    finally:
        program.close()
