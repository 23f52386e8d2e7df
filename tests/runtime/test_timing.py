"""The device clock (``runtime/base/timing.py``) and who reads it: stage costs (``ModelRunner``) and
calibration. The CUDA branch runs here against fake CUDA events (monkeypatched): both events go on the
stream given (or the device's current one), and the elapsed time is read from them lazily."""

import types

import pytest
import torch

from saguaro.capture.export import ModelSpec
from saguaro.core.stages import DRAFT_STEP, ROUND_STAGES, TARGET_VERIFY, TARGET_VERIFY_ROUND
from saguaro.runtime import calibration
from saguaro.runtime.base import model_runner, timing, trace
from saguaro.runtime.base.model_runner import ModelRunner
from tests.conftest import tiny_pair


class FakeEvent:
    """A CUDA event: records on a stream, completes when its stream says so, times in milliseconds."""

    log: list = []

    def __init__(self, enable_timing=False):
        assert enable_timing, "timing events must be created with enable_timing=True"
        self.stream = None

    def record(self, stream):
        self.stream = stream
        self.stamp = stream.clock
        FakeEvent.log.append(("record", stream.name, self.stamp))

    def query(self):
        return self.stream.done

    def synchronize(self):
        FakeEvent.log.append(("synchronize", self.stream.name))
        self.stream.done = True

    def elapsed_time(self, end):
        assert end.stream is self.stream, "both events of an interval are on one stream"
        FakeEvent.log.append(("elapsed_time", self.stream.name))
        return float(end.stamp - self.stamp)  # ms


class FakeStream:
    def __init__(self, name):
        self.name, self.clock, self.done = name, 0, False


@pytest.fixture
def fake_cuda(monkeypatch):
    """``torch.cuda.Event`` and ``current_stream`` faked; returns the current stream of every device."""
    FakeEvent.log = []
    current = FakeStream("current")
    asked = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: asked.append(device) or current)
    return types.SimpleNamespace(current=current, asked=asked)


def test_on_cpu_a_stopwatch_reads_the_host_clock():
    interval = timing.Stopwatch("cpu").stop()
    assert interval.ready() and interval.seconds >= 0.0 and isinstance(interval.seconds, float)


def test_on_cuda_a_stopwatch_records_two_events_on_the_current_stream_and_reads_them_lazily(fake_cuda):
    watch = timing.Stopwatch(torch.device("cuda:1"))
    assert fake_cuda.asked == [torch.device("cuda:1")]
    fake_cuda.current.clock = 7  # 7 ms of work queued on the stream in between
    interval = watch.stop()
    assert FakeEvent.log == [("record", "current", 0), ("record", "current", 7)]
    assert not interval.ready(), "the work has not run yet: nothing may wait for it here"
    assert interval.seconds == pytest.approx(0.007)
    # the first read waited for the end event only (not the device), then read the events' elapsed time
    assert FakeEvent.log[2:] == [("synchronize", "current"), ("elapsed_time", "current")]
    assert interval.ready() and interval.seconds == pytest.approx(0.007) and len(FakeEvent.log) == 4


def test_on_cuda_a_stopwatch_times_the_stream_it_is_given(fake_cuda):
    lane = FakeStream("lane")
    watch = timing.Stopwatch(torch.device("cuda:0"), stream=lane)
    lane.clock, lane.done = 3, True
    interval = watch.stop()
    assert fake_cuda.asked == [] and interval.ready()
    assert interval.seconds == pytest.approx(0.003)
    assert {entry[1] for entry in FakeEvent.log} == {"lane"}


def test_work_queued_while_a_cuda_graph_is_captured_is_timed_on_the_host(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    interval = timing.Stopwatch(torch.device("cuda:0")).stop()
    assert interval.ready() and FakeEvent.log == [] and fake_cuda.asked == []


def test_an_interval_is_host_seconds_or_two_events():
    with pytest.raises(ValueError, match="either host seconds or a pair of CUDA events"):
        timing.Interval()


class PendingInterval:
    """An Interval whose device work finishes when the test says so."""

    def __init__(self, seconds, done=False):
        self._seconds, self.done, self.waited = seconds, done, False

    def ready(self):
        return self.done

    @property
    def seconds(self):
        self.waited = not self.done
        return self._seconds


def bare_runner(device="cpu") -> ModelRunner:
    spec = types.SimpleNamespace(device=torch.device(device))
    return ModelRunner("draft", types.SimpleNamespace(spec=spec), build=None, width=4)


def test_stage_costs_fold_finished_timings_in_order_and_wait_only_when_read():
    runner = bare_runner()
    first, second = PendingInterval(1.0, done=True), PendingInterval(3.0)
    runner._timed("draft.glue", first)
    runner._timed("draft.glue", second)
    assert runner._stage_cost_s == {"draft.glue": 1.0}  # the first was folded; the second still runs
    assert not second.waited
    assert runner.stage_cost_s == {"draft.glue": pytest.approx(0.9 * 1.0 + 0.1 * 3.0)}
    assert second.waited, "reading the costs waits for the stage calls still on the device"


def test_a_long_queue_of_unfinished_timings_waits_for_the_oldest(monkeypatch):
    monkeypatch.setattr(model_runner, "MAX_PENDING", 2)
    runner = bare_runner()
    for _ in range(3):
        runner._timed("target.verify_greedy", PendingInterval(2.0))
    assert runner._stage_cost_s == {"target.verify_greedy": 2.0} and not runner._timings


def test_stage_costs_are_measured_by_the_device_clock_of_the_runner(monkeypatch):
    """A real stage call: its cost is what a Stopwatch on the runner's device measured."""
    _, _, program = tiny_pair("llama")
    runner = program.target
    devices = []

    class Watch:
        def __init__(self, device, stream=None):
            devices.append(device)

        def stop(self):
            return timing.Interval(0.25)

    monkeypatch.setattr(model_runner, "Stopwatch", Watch)
    verify = TARGET_VERIFY_ROUND.qualified  # the verify greedy rounds run, with their commit
    runner._stage_cost_s.pop(verify, None)
    calibration.time_verify_alone(
        runner, batch=1, capacity=16, k=4, temperature=0.0, vocab_size=128, repeats=1
    )
    assert devices == [runner.spec.device] and runner.stage_cost_s[verify] == 0.25
    monkeypatch.setattr(runner, "provides", lambda stage: stage not in ROUND_STAGES)  # a builder without it
    plain = TARGET_VERIFY.for_temperature(0.0).qualified
    runner._stage_cost_s.pop(plain, None)
    calibration.time_verify_alone(
        runner, batch=1, capacity=16, k=4, temperature=0.0, vocab_size=128, repeats=1
    )
    assert runner.stage_cost_s[plain] == 0.25


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_calibration_times_the_verify_on_the_device_clock_and_keeps_the_least(monkeypatch, temperature):
    _, _, program = tiny_pair("llama")
    readings = iter([0.3, 0.1, 0.2])
    devices = []

    class Watch:
        def __init__(self, device, stream=None):
            devices.append(device)

        def stop(self):
            return timing.Interval(next(readings))

    monkeypatch.setattr(calibration, "Stopwatch", Watch)
    monkeypatch.setattr(
        torch.cuda, "synchronize", lambda *a: pytest.fail("calibration synchronised a device")
    )
    best = calibration.time_verify_alone(
        program.target, batch=2, capacity=16, k=4, temperature=temperature, vocab_size=128
    )
    assert best == 0.1 and devices == [program.target.spec.device] * 3


def test_an_sd_round_is_the_verify_and_k_draft_steps_on_the_device_clock(monkeypatch):
    _, _, program = tiny_pair("llama")
    devices = []

    class Watch:
        def __init__(self, device, stream=None):
            devices.append(device)

        def stop(self):
            return timing.Interval(0.5 if len(devices) <= calibration.REPEATS else 2.0)

    monkeypatch.setattr(calibration, "Stopwatch", Watch)
    round_s = calibration.time_sd_round(
        program.target, program.draft, batch=1, target_capacity=16, draft_capacity=16, k=4, temperature=0.0
    )
    assert round_s == pytest.approx(2.0 + 4 * 0.5)
    assert devices == [program.draft.spec.device] * 3 + [program.target.spec.device] * 3


def test_a_traced_stage_on_cuda_carries_its_device_time_read_when_the_trace_is_taken(monkeypatch):
    """The slice spans the launch; ``device_ms`` is the device's time (a fake CUDA stopwatch here)."""
    spec = ModelSpec(
        model_class="Tiny",
        num_layers=1,
        num_heads=2,
        num_kv_heads=2,
        head_dim=4,
        vocab_size=16,
        max_positions=32,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    runner = ModelRunner(
        "draft", types.SimpleNamespace(spec=spec), build=lambda stage: lambda *a: (a[0][:, -1],), width=4
    )
    pending = PendingInterval(0.004)

    class CudaWatch:
        stream = "the lane's stream"

        def __init__(self, device, stream=None):
            pass

        def stop(self):
            return pending

    monkeypatch.setattr(model_runner, "Stopwatch", CudaWatch)
    monkeypatch.setattr(trace, "Interval", PendingInterval)
    runner.recorder = trace.TraceRecorder()
    ids = torch.zeros(1, 1, dtype=torch.long)
    runner.run(DRAFT_STEP.for_temperature(0.0), runner.new_store(1, 4), ids, ids.clone(), ids.clone())
    begin = runner.recorder.events[0]
    assert begin[0] == "B" and begin[4]["device_ms"] is pending and not pending.waited
    pending.done = True
    taken = runner.recorder.take()["events"]
    assert taken[0][4] == {"rows": 1, "tokens": 1, "device_ms": pytest.approx(4.0)}


def test_taking_a_trace_reads_device_timings_as_milliseconds():
    recorder = trace.TraceRecorder()
    recorder.begin("draft", "draft.glue", {"rows": 2, "device_ms": timing.Interval(0.0015)})
    recorder.end("draft", "draft.glue")
    events = recorder.take()["events"]
    assert events[0][4] == {"rows": 2, "device_ms": pytest.approx(1.5)} and events[1][4] is None
