"""``LateRead`` (``runtime/base/timing.py``): a small device value read on the host a round late. On the
CPU it holds the value; its CUDA branch runs here on fake events and plain CPU tensors standing for
pinned memory: a ``non_blocking`` copy into buffers reused in turn, an event recorded after each copy,
and a take that waits only for the older post's event. Also ``Counters.settle``: verify intervals are
counted once ready, never waited for."""

import pytest
import torch

from saguaro.runtime.base import timing
from saguaro.runtime.base.stats import Counters


class Event:
    """A CUDA event in a log; ``passed`` marks the ones the device has got past."""

    log: list = []

    def __init__(self, enable_timing=False):
        self.passed = False

    def record(self, stream=None):
        Event.log.append(("record", self))

    def query(self):
        return self.passed

    def synchronize(self):
        Event.log.append(("synchronize", self))
        self.passed = True


def test_on_cpu_a_value_is_taken_a_post_late():
    late = timing.LateRead("cpu")
    assert not late.cuda
    late.post(torch.tensor(3))
    with pytest.raises(RuntimeError, match="a round late"):
        late.take()  # nothing queued behind it: that would be a sync
    late.post(torch.tensor(2))
    assert late.take() == 3 and late.pending == 1
    late.post(torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match="take the oldest"):
        late.post(torch.tensor(9))  # a third post would reuse the buffer of a value not taken
    assert late.take() == 2 and late.pending == 1


def test_on_cuda_the_copy_is_non_blocking_into_pinned_buffers_and_the_wait_is_for_the_older_round(
    monkeypatch,
):
    Event.log = []
    allocated, copies = [], []
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(
        timing, "pinned_like", lambda value: allocated.append(torch.empty_like(value)) or allocated[-1]
    )
    copy = torch.Tensor.copy_

    def logged_copy(tensor, source, non_blocking=False):
        copies.append((tensor, non_blocking))
        Event.log.append(("copy", tensor))
        return copy(tensor, source, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", logged_copy)

    late = timing.LateRead(torch.device("cuda", 0))
    assert late.cuda
    values = [torch.tensor(v) for v in (5, 4, 4, 0)]
    taken = []
    for step, value in enumerate(values):
        late.post(value)
        value.fill_(-1)  # the device moves on: the host reads the copy made when it was posted
        if step:
            taken.append(late.take())
    assert taken == [5, 4, 4]
    assert len(allocated) == timing.LateRead.DEPTH  # two pinned buffers, reused in turn
    assert [c[0] for c in copies] == [allocated[i % 2] for i in range(4)] and all(nb for _, nb in copies)
    records = [e for kind, e in Event.log if kind == "record"]
    waits = [e for kind, e in Event.log if kind == "synchronize"]
    assert waits == records[:3]  # each take waits for the older post's event, never the newest's
    kinds = [kind for kind, _ in Event.log]
    assert kinds[:3] == ["copy", "record", "copy"]  # the event follows its copy on the stream
    assert kinds.index("synchronize") > kinds.index("copy", 1)  # the first wait comes after the next post


class Pending:
    def __init__(self, seconds):
        self.seconds, self.done = seconds, False

    def ready(self):
        return self.done


def test_verify_time_is_counted_once_its_events_have_passed():
    counters = Counters(k=3)
    first, second = Pending(0.5), Pending(0.25)
    counters.time_verify(first)
    counters.time_verify(second)
    assert counters.verify_s == 0.0 and counters.verify_pending == [first, second]  # nothing waited for
    second.done = True
    counters.settle()
    assert counters.verify_s == 0.0  # in order: the older first
    first.done = True
    counters.settle()
    assert counters.verify_s == 0.75 and not counters.verify_pending


def test_a_neural_fallback_time_is_read_once_ready():
    from saguaro.runtime.draft.fallback import FallbackPolicy

    policy = FallbackPolicy("neural", batch=2)
    first, second = Pending(0.5), Pending(0.25)
    assert policy.time_neural(first) == [] and list(policy.neural_s) == []  # not ready: not waited for
    first.done = second.done = True
    assert policy.time_neural(second) == [0.5, 0.25] and list(policy.neural_s) == [0.5, 0.25]
