"""The draft lane as a type: server methods travel as ``Method`` members, the draft process refuses
anything else and keeps serving, and the lane fallback chain is data (``LANES``)."""

import pickle
import socket
import threading
import warnings
from multiprocessing.connection import Connection

import pytest
import torch

from saguaro.core.config import MODES
from saguaro.runtime.decode import DECODERS
from saguaro.runtime.lanes import owner as lane_owner
from saguaro.runtime.lanes.process import ProcessLane, serve
from saguaro.runtime.lanes.protocol import DraftLane, DraftLaneError, Method, check_methods
from saguaro.runtime.lanes.thread import ThreadLane
from tests.conftest import tiny_program
from tests.models import prompts, reference_greedy


def test_a_server_without_a_lane_method_is_refused_at_once():
    class Incomplete:
        def open(self, spec):
            pass

    with pytest.raises(TypeError, match=r"Incomplete lacks the lane methods \['start', 'build'"):
        check_methods(Incomplete)


def test_every_mode_has_a_decoder_and_the_lanes_satisfy_the_protocol():
    assert set(DECODERS) == set(MODES)
    members = {"kind", "recorder", "post", "call", "settle", "take_trace", "close"}
    declared = set(DraftLane.__annotations__) | {
        n for n, v in vars(DraftLane).items() if callable(v) and not n.startswith("_")
    }
    assert declared == members
    for lane in (ThreadLane, ProcessLane):
        assert not members - set(dir(lane)), lane


class _FakeServer:
    """Just enough of a SpeculationServer for the draft process's loop."""

    class draft:
        recorder = None

    def open(self, spec):
        self.opened = spec

    def finished(self):
        return self.opened == "spec"


def test_the_draft_process_refuses_a_method_given_as_a_string_and_keeps_serving():
    ours, theirs = socket.socketpair()
    caller, server_end = Connection(ours.detach()), Connection(theirs.detach())
    loop = threading.Thread(target=serve, args=(server_end, _FakeServer()), daemon=True)
    loop.start()
    try:
        caller.send_bytes(pickle.dumps((1, "finished", (), True)))  # a name, not a Method: refused
        seq, ok, value, _ = pickle.loads(caller.recv_bytes())
        assert (seq, ok) == (1, False) and "not a draft server method: 'finished'" in value
        caller.send_bytes(pickle.dumps((2, Method.FINISHED, (), True)))
        seq, ok, value, _ = pickle.loads(caller.recv_bytes())
        assert (seq, ok) == (2, False)  # a failure stands until a generation opens afresh ...
        caller.send_bytes(pickle.dumps((3, Method.OPEN, ("spec",), False)))  # ... as this one does
        caller.send_bytes(pickle.dumps((4, Method.FINISHED, (), True)))
        seq, ok, value, _ = pickle.loads(caller.recv_bytes())
    finally:
        caller.close()
        loop.join(timeout=5)
    assert (seq, ok, value) == (4, True, True)
    assert not loop.is_alive()  # end-of-file ended the loop


def test_a_lane_kind_that_cannot_start_gives_way_down_the_registered_chain(monkeypatch):
    target, _, program = tiny_program("llama", k=3, mode="ssd", lane="process")
    attempts = []

    def broken(owner):
        attempts.append(owner.kind)
        raise DraftLaneError("no such device")

    monkeypatch.setitem(lane_owner.LANES, "process", lane_owner.LaneKind(broken, falls_back_to="thread"))
    ids, mask = prompts(1, 6, seed=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = program.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=None)
    program.close()
    assert attempts == ["process"]
    assert [str(w.message) for w in caught if "cannot start" in str(w.message)] == [
        "saguaro: the process lane cannot start: no such device; SSD uses the thread lane instead until close()"
    ]
    assert out.stats["lane"] == "thread" and out.stats["mode"] == "ssd"
    assert torch.equal(out.sequences, reference_greedy(target, ids, mask, 10))


def test_registering_a_lane_that_falls_back_to_an_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="falls back to 'carrier pigeon', which is not registered"):
        lane_owner.register_lane("avian", lambda owner: None, falls_back_to="carrier pigeon")
    assert "avian" not in lane_owner.LANES


def test_plan_costs_travel_over_the_remote_wire_as_the_warm_up_costs_do():
    """``plan_costs`` (the builds calibration timed against the verify) takes no argument and answers stage
    costs, or nothing without a planner; it came after every earlier one, which keep their numbers."""
    from saguaro.runtime.draft.planner import StageCosts
    from saguaro.runtime.lanes.remote_messages import (
        METHODS,
        Bounds,
        decode_args,
        decode_result,
        encode_args,
        encode_result,
    )

    assert METHODS.index(Method.PLAN_COSTS) == 10 and METHODS.index(Method.TRACE_TAKE) == 9
    bounds = Bounds(vocab=16, k=3, max_capacity=64)
    assert encode_args(Method.PLAN_COSTS, ()) == [] and decode_args(Method.PLAN_COSTS, [], bounds) == ()
    costs = StageCosts(glue_s=1.5e-3, step_s=None, tree_s={4: 4e-3, 8: 4.5e-3}, verify_s={0: 7e-3})
    back = decode_result(
        Method.PLAN_COSTS, encode_result(Method.PLAN_COSTS, costs), bounds, torch.device("cpu")
    )
    assert (back.glue_s, back.step_s, back.tree_s, back.verify_s) == (
        1.5e-3,
        None,
        {4: 4e-3, 8: 4.5e-3},
        {0: 7e-3},
    )
    assert (
        decode_result(Method.PLAN_COSTS, encode_result(Method.PLAN_COSTS, None), bounds, torch.device("cpu"))
        is None
    )


def test_row_changes_travel_over_the_remote_wire_and_move_both_sides_batch():
    """``join_rows`` (a one-row spec and its first token; the answer a one-row speculation) and ``keep_rows``
    (increasing row indices) come after every earlier method, so those keep their numbers; each side's batch
    follows them (``sent_batch`` on the caller's, ``decode_args`` on the server's), and bad rows are refused."""
    from saguaro.runtime.base.wire import WireError
    from saguaro.runtime.draft.server import GenerateSpec, Speculation
    from saguaro.runtime.lanes.remote_messages import (
        METHODS,
        Bounds,
        decode_args,
        decode_result,
        encode_args,
        encode_result,
        sent_batch,
    )

    assert METHODS[-2:] == (Method.JOIN_ROWS, Method.KEEP_ROWS) and METHODS.index(Method.PLAN_COSTS) == 10
    caller, server = Bounds(vocab=16, k=3, max_capacity=64), Bounds(vocab=16, k=3, max_capacity=64)
    two = GenerateSpec(
        torch.tensor([[1, 2, 3], [0, 4, 5]]), torch.tensor([[1, 1, 1], [0, 1, 1]]), 8, 32, [2], 0, 0.0, None
    )
    for method, args in (
        (Method.OPEN, (two,)),
        (
            Method.JOIN_ROWS,
            (
                GenerateSpec(
                    torch.tensor([[6, 7]]), torch.ones(1, 2, dtype=torch.long), 4, 32, [2], 0, 0.0, None
                ),
                torch.tensor([9]),
            ),
        ),
    ):
        sent_batch(caller, method, args)
        got = decode_args(method, encode_args(method, args), server)
        assert torch.equal(got[0].input_ids, args[0].input_ids)
    assert caller.batch == server.batch == 3
    one = Speculation(torch.tensor([[1, 2, 3]]), None, [1])
    back = decode_result(Method.JOIN_ROWS, encode_result(Method.JOIN_ROWS, one), caller, torch.device("cpu"))
    assert back.tokens.tolist() == [[1, 2, 3]] and back.source == [1]
    sent_batch(caller, Method.KEEP_ROWS, ([0, 2],))
    assert decode_args(Method.KEEP_ROWS, encode_args(Method.KEEP_ROWS, ([0, 2],)), server) == ([0, 2],)
    assert caller.batch == server.batch == 2
    for bad in ([], [1, 0], [0, 2]):
        with pytest.raises(WireError, match="keep_rows"):
            decode_args(Method.KEEP_ROWS, encode_args(Method.KEEP_ROWS, (bad,)), server)
