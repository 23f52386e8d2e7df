"""The hand-off between the caller and an in-process lane (``runtime/lanes/streams.py``): on CPU it
moves nothing and waits for nothing; its CUDA branch runs here against fake streams and events
(monkeypatched), which log every record, wait and ``record_stream``, so the order is checked."""

import dataclasses
import types
from collections import namedtuple
from contextlib import contextmanager

import pytest
import torch

from saguaro.runtime.draft.server import GenerateSpec, Lookup, Speculation
from saguaro.runtime.lanes import streams
from saguaro.runtime.lanes.protocol import Method
from saguaro.runtime.lanes.streams import StreamHandoff, map_tensors, tensors_in
from saguaro.runtime.lanes.thread import ThreadLane


def speculation(tokens, probs=None):
    return Speculation(tokens, probs, [0] * tokens.shape[0])  # source: host ints


def test_map_tensors_keeps_what_it_does_not_change_and_never_modifies_a_dataclass():
    kept = speculation(torch.ones(2, 3, dtype=torch.long))
    assert map_tensors(kept, lambda t: t) is kept
    pair = namedtuple("Pair", "a b")(torch.zeros(1), 2)
    nested = (kept, [torch.ones(1)], {"x": torch.zeros(2)}, pair, 3.0, None)
    assert map_tensors(nested, lambda t: t) is nested
    doubled = map_tensors(Lookup([True, False], kept), lambda t: t * 2)
    assert doubled.speculation is not kept and torch.equal(doubled.speculation.tokens, kept.tokens * 2)
    assert doubled.hit == [True, False] and doubled.speculation.source is kept.source
    assert torch.equal(kept.tokens, torch.ones(2, 3, dtype=torch.long))  # the server's own object as it was
    moved = map_tensors(nested, lambda t: t + 1)
    assert type(moved[3]).__name__ == "Pair" and moved[3].b == 2 and moved[4:] == (3.0, None)
    assert len(tensors_in(nested)) == 4


def test_on_cpu_the_handoff_moves_nothing_and_has_no_stream():
    handoff = StreamHandoff(torch.device("cpu"))
    spec = GenerateSpec(
        torch.ones(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.long), 8, 32, [], 0, 0.0, None
    )
    ticket = handoff.send((spec, torch.zeros(1)))
    assert handoff.stream is None and ticket.ready is None and ticket.args[0] is spec
    result = speculation(torch.ones(1, 3, dtype=torch.long))
    reply = handoff.serve(ticket, lambda *args: result)
    assert reply.done is None and handoff.receive(reply) is result


class FakeEvent:
    def __init__(self, log):
        self.log, self.name = log, f"event{len([e for e in log if e[0] == 'new event'])}"
        log.append(("new event", self.name))

    def record(self, stream):
        self.log.append(("record", self.name, stream.name))


class FakeStream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_event(self, event):
        self.log.append(("wait", self.name, event.name))

    def synchronize(self):
        raise AssertionError("a host synchronisation of the lane's stream")


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA streams, events, ``record_stream`` and device copies faked on CPU, all logged in order."""
    log, current = [], {}
    caller = FakeStream(log, "caller")

    @contextmanager
    def use(stream):
        log.append(("enter", stream.name))
        current["lane"] = stream
        yield
        current.pop("lane")
        log.append(("exit", stream.name))

    def copy(tensor, device):
        log.append(("copy", tuple(tensor.flatten().tolist()), str(device), current.get("lane", caller).name))
        return tensor.clone()

    cuda = types.SimpleNamespace(
        Stream=lambda device: FakeStream(log, f"lane@{device}"),
        Event=lambda: FakeEvent(log),
        current_stream=lambda device: log.append(("current_stream", str(device))) or caller,
        stream=use,
    )
    for name, value in vars(cuda).items():
        monkeypatch.setattr(torch.cuda, name, value)

    def record_stream(tensor, stream):
        log.append(("record_stream", tuple(tensor.flatten().tolist()), stream.name))

    monkeypatch.setattr(streams, "_record_stream", record_stream)
    monkeypatch.setattr(streams, "to_device", copy)
    return types.SimpleNamespace(log=log, current=current)


def test_on_cuda_each_crossing_is_ordered_by_an_event_and_copied_on_the_producing_stream(fake_cuda):
    log = fake_cuda.log
    handoff = StreamHandoff(torch.device("cuda:1"))
    accepted, outcome = torch.tensor([2]), torch.tensor([7])
    ticket = handoff.send((accepted, outcome, 0.5))
    assert ticket.caller == accepted.device  # where the result goes back
    cached = speculation(torch.tensor([[4, 5, 6]]), probs=torch.full((1, 3, 1), 0.5))

    def match(a, r, verify_s):
        log.append(("method runs on", fake_cuda.current["lane"].name))
        assert verify_s == 0.5 and a is not accepted  # the lane got its own copies
        return Lookup([True], cached)

    value = handoff.receive(handoff.serve(ticket, match))
    assert torch.equal(value.speculation.tokens, cached.tokens) and value.speculation is not cached
    lane, cpu = "lane@cuda:1", str(accepted.device)
    assert log == [
        # send, on the caller's thread: copies on the caller's stream, then the event the lane waits for
        ("copy", (2,), "cuda:1", "caller"),
        ("copy", (7,), "cuda:1", "caller"),
        ("current_stream", cpu),
        ("new event", "event0"),
        ("record", "event0", "caller"),
        # serve: on the lane's stream, after the caller's work; the arguments marked as used there
        ("enter", lane),
        ("wait", lane, "event0"),
        ("record_stream", (2,), lane),
        ("record_stream", (7,), lane),
        ("method runs on", lane),
        ("copy", (4, 5, 6), cpu, lane),
        ("copy", (0.5, 0.5, 0.5), cpu, lane),
        ("new event", "event1"),
        ("record", "event1", lane),
        ("exit", lane),
        # receive: the caller's stream waits for the lane, the result marked as used there
        ("wait", "caller", "event1"),
        ("record_stream", (4, 5, 6), "caller"),
        ("record_stream", (0.5, 0.5, 0.5), "caller"),
    ]


class FakeServer:
    def __init__(self):
        self.built = 0

    def build(self):
        self.built += 1

    def finished(self):
        return self.built == 1


def test_the_thread_lane_on_cuda_hands_off_by_events_and_never_synchronises(fake_cuda):
    log = fake_cuda.log
    lane = ThreadLane(FakeServer(), torch.device("cuda:0"), timeout_s=10.0)
    try:
        lane.post(Method.BUILD)
        assert lane.call(Method.FINISHED) is True
    finally:
        lane.close()
    lane_stream = "lane@cuda:0"
    waits = [entry for entry in log if entry[0] == "wait"]
    # build: the lane waits for the caller's event0; the caller waits for the build's event1 when it
    # settles; finished: the lane waits for event2, the caller for event3
    assert waits == [
        ("wait", lane_stream, "event0"),
        ("wait", "caller", "event1"),
        ("wait", lane_stream, "event2"),
        ("wait", "caller", "event3"),
    ]
    assert [e for e in log if e[0] == "record"] == [
        ("record", "event0", "caller"),
        ("record", "event1", lane_stream),
        ("record", "event2", "caller"),
        ("record", "event3", lane_stream),
    ]


def test_a_dataclass_result_crossing_keeps_its_type_and_fields(fake_cuda):
    handoff = StreamHandoff(torch.device("cuda:0"))
    spec = GenerateSpec(
        torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long), 4, 16, [3], 0, 0.0, None
    )
    ticket = handoff.send((spec,))
    sent = ticket.args[0]
    assert isinstance(sent, GenerateSpec) and sent is not spec and sent.input_ids is not spec.input_ids
    assert torch.equal(sent.input_ids, spec.input_ids) and torch.equal(
        sent.attention_mask, spec.attention_mask
    )
    rest = [f.name for f in dataclasses.fields(spec) if f.name not in ("input_ids", "attention_mask")]
    assert [getattr(sent, name) for name in rest] == [getattr(spec, name) for name in rest]


def test_the_verify_stream_runs_a_block_on_a_high_priority_stream_ordered_both_ways(monkeypatch):
    """Where the lane shares the target's GPU, the caller's side of SSD runs on a high-priority stream: it
    waits for the caller's stream on entry, the caller's stream waits for it on exit (events, no host
    synchronisation), and one stream per device is made once and reused."""
    from tests.lower.fake_cuda import FakeCuda

    cuda = FakeCuda().install(monkeypatch)
    verify = streams.VerifyStream()
    for _ in range(2):
        with verify.over(torch.device("cuda:0")) as stream:
            assert torch.cuda.current_stream() is stream and stream.priority == streams.HIGH_PRIORITY < 0
            cuda.events.append(("verify runs on", torch.cuda.current_stream().name))
        assert torch.cuda.current_stream() is cuda.current  # the caller's stream again
    assert len(cuda.streams) == 1 and cuda.streams[0].device == torch.device("cuda:0")
    one_block = [
        ("wait", "high-priority", "current"),
        ("stream", "high-priority"),
        ("verify runs on", "high-priority"),
        ("wait", "current", "high-priority"),
    ]
    assert cuda.events == one_block * 2
    # inactive (no lane on this GPU), or not CUDA: nothing changes, no stream is made
    for device, active in ((torch.device("cuda:0"), False), (torch.device("cpu"), True)):
        with verify.over(device, active) as stream:
            assert stream is None
    assert len(cuda.events) == 8 and len(cuda.streams) == 1


def test_same_gpu_compares_cuda_devices_with_the_current_one_for_no_index(monkeypatch):
    from tests.lower.fake_cuda import FakeCuda

    FakeCuda().install(monkeypatch)  # the current device is 0
    cuda, cuda0, cuda1 = torch.device("cuda"), torch.device("cuda:0"), torch.device("cuda:1")
    assert streams.same_gpu(cuda0, cuda0) and streams.same_gpu(cuda, cuda0) and streams.same_gpu(cuda0, cuda)
    assert not streams.same_gpu(cuda0, cuda1) and not streams.same_gpu(cuda0, None)
    assert not streams.same_gpu(torch.device("cpu"), torch.device("cpu"))


@pytest.mark.parametrize(
    "lane, draft_device, prioritised",
    [
        ("thread", "cuda:0", True),  # the lane's build and the verify share the GPU
        ("thread", "cuda:1", False),  # draft_device: the draft has a GPU of its own
        ("remote", "cuda:0", False),  # the draft runs on another machine
    ],
)
def test_ssd_rounds_run_on_the_priority_stream_only_where_the_lane_shares_the_gpu(
    monkeypatch, lane, draft_device, prioritised
):
    from saguaro.core.config import SaguaroConfig
    from saguaro.runtime.lanes.owner import LaneOwner
    from tests.lower.fake_cuda import FakeCuda

    cuda = FakeCuda().install(monkeypatch)
    draft = types.SimpleNamespace(spec=types.SimpleNamespace(device=torch.device(draft_device)))
    remote = {"draft_address": "127.0.0.1:1"} if lane == "remote" else {}  # never connected to here
    owner = LaneOwner(SaguaroConfig(lane=lane, **remote), draft, remote_draft=None)
    threads = torch.get_num_threads()
    with owner.ssd_context(torch.device("cuda:0")):
        running = torch.cuda.current_stream()
        assert torch.get_num_threads() == threads  # on CUDA no intra-op thread setting changes
    assert (running.name == "high-priority") is prioritised and (running is cuda.current) is not prioritised
    assert len(cuda.streams) == int(prioritised)


def test_on_cpu_ssd_rounds_give_each_lane_one_thread_and_no_stream():
    from saguaro.core.config import SaguaroConfig
    from saguaro.runtime.lanes.owner import LaneOwner

    draft = types.SimpleNamespace(spec=types.SimpleNamespace(device=torch.device("cpu")))
    owner = LaneOwner(SaguaroConfig(lane="thread"), draft, remote_draft=None)
    threads = torch.get_num_threads()
    with owner.ssd_context(torch.device("cpu")):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == threads
