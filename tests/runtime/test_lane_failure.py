"""A draft-lane failure mid-generation still yields the exact greedy output, with a warning."""

import threading

import pytest
import torch

import saguaro
from saguaro.runtime.decode import ssd
from saguaro.runtime.draft import tree
from tests.conftest import tiny_pair, tiny_program
from tests.models import prompts, reference_greedy


def failing_after(calls, exc):
    """``tree.build_speculations`` that raises ``exc`` from its ``calls + 1``-th call on."""
    real = tree.build_speculations
    count = {"n": 0}

    def build(*args):
        count["n"] += 1
        if count["n"] > calls:
            raise exc
        return real(*args)

    return build


def test_exception_on_draft_lane_finishes_with_sd(monkeypatch):
    target, _, program = tiny_program("llama", k=3, mode="ssd", lane="thread")
    ids, mask = prompts(3, 8, seed=5, pad_rows={0: 2})
    program.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=None)  # the lane's warm-up
    monkeypatch.setattr(tree, "build_speculations", failing_after(2, RuntimeError("draft device lost")))
    with pytest.warns(RuntimeWarning, match="draft device lost.*SD"):
        out = program.generate(ids, attention_mask=mask, max_new_tokens=20, eos_token_id=None)
    assert torch.equal(out.sequences, reference_greedy(target, ids, mask, 20))
    assert out.stats["lane_failures"] == 1
    assert program.lanes.failed_lanes == 1  # dropped, counted; closing a lane is not a failure
    program.close()
    assert program.lanes.failed_lanes == 1


def test_timeout_on_draft_lane_finishes_with_sd_on_a_fresh_store(monkeypatch):
    """The second build of the generation never answers on its own: it is held on an event, released only
    once the caller has given up on it and turned to SD (no race between a sleep and the timeout)."""
    target, _, program = tiny_program("llama", k=3, mode="ssd", lane="thread", lane_timeout_s=0.2)
    ids, mask = prompts(1, 8, seed=6)
    program.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=None)  # the lane's warm-up
    real_build, real_finish = tree.build_speculations, ssd._finish_with_sd
    held, release, count, gave_up = threading.Event(), threading.Event(), {"n": 0}, []

    def build(*args):
        count["n"] += 1
        if count["n"] > 1:
            held.set()
            release.wait(timeout=120)  # a bound only so that a broken timeout fails the test, not hangs it
        return real_build(*args)

    def finish_with_sd(*args):
        gave_up.append(held.is_set() and not release.is_set())  # the build was still running
        release.set()  # the worker may end now (dropping the lane waits for it)
        return real_finish(*args)

    monkeypatch.setattr(tree, "build_speculations", build)
    monkeypatch.setattr(ssd, "_finish_with_sd", finish_with_sd)
    try:
        with pytest.warns(RuntimeWarning, match="no answer within.*SD"):
            out = program.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=None)
    finally:
        release.set()
    assert gave_up == [True]
    assert torch.equal(out.sequences, reference_greedy(target, ids, mask, 16))
    assert out.stats["lane_failures"] == 1
    # the failed lane was dropped; the next generation gets a fresh one and runs SSD again
    monkeypatch.undo()
    again = program.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=None)
    assert torch.equal(again.sequences, out.sequences) and again.stats["lane_failures"] == 0


def test_dead_draft_process_finishes_with_sd():
    target, _, program = tiny_program("llama", k=3, mode="ssd", lane="process", lane_timeout_s=30)
    ids, mask = prompts(2, 8, seed=7, pad_rows={1: 3})
    expected = reference_greedy(target, ids, mask, 16)
    try:
        first = program.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=None)
        assert torch.equal(first.sequences, expected) and first.stats["lane"] == "process"
        program.lanes.lane().lane.process.kill()
        program.lanes.lane().lane.process.wait()
        with pytest.warns(RuntimeWarning, match="dead.*SD"):
            out = program.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=None)
        assert torch.equal(out.sequences, expected) and out.stats["lane_failures"] == 1
    finally:
        program.close()


def test_auto_lane_is_the_process_lane_for_eager_on_cpu_and_the_thread_lane_for_inductor():
    target, draft, eager = tiny_pair("llama")  # compiled with the default lane ("auto")
    assert eager.reconfigure(mode="ssd").lane_kind == "process"
    assert (
        saguaro.compile(target, draft, mode="ssd", backend="inductor", sd_when_faster=False).lane_kind
        == "thread"
    )
    assert eager.reconfigure(mode="ssd", lane="thread").lane_kind == "thread"


def test_a_lane_that_cannot_start_falls_back_to_sd(monkeypatch):
    from saguaro.runtime.lanes import owner as lane_owner
    from saguaro.runtime.lanes import thread as lanes

    target, _, program = tiny_program("llama", k=3, mode="ssd", lane="thread")

    def broken(*args, **kwargs):
        raise lanes.DraftLaneError("draft process exited during start-up (exit code 1)")

    monkeypatch.setattr(lane_owner, "ThreadLane", broken)
    ids, mask = prompts(1, 6, seed=8)
    with pytest.warns(RuntimeWarning, match="start-up.*generating with SD"):
        out = program.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=None)
    assert torch.equal(out.sequences, reference_greedy(target, ids, mask, 10)) and out.stats["mode"] == "sd"
