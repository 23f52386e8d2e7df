"""The compile helper (``saguaro/lower/compile_helper.py``): a second process compiles queued stages so
that the compile thread's own compile of them reads Inductor's caches. The stage graph travels node for
node (``graph_transport``) and comes back with the same code; the thread hands the helper a job only
while it compiles another, takes the helper's finished jobs first, and compiles a job itself when the
helper fails it or dies. One test runs a real helper process beside a background compile."""

import io
import threading
import time

import pytest
import torch
from torch._dynamo.utils import counters

import saguaro
from saguaro.lower import compile_helper, graph_transport
from saguaro.lower.compile_helper import CompileHelper, read_message, write_message
from saguaro.lower.compile_thread import BackgroundCompiler
from saguaro.lower.graph_transport import EmptyTensor, pack_graph, unpack_graph
from saguaro.passes.base.graph_splice import get_attribute
from tests.models import prompts, reference_greedy, tiny_target, truncated_draft


def stage_graph():
    """A stage GraphModule after the passes (slices of symbolic sizes, builtins, getattr, custom ops)."""
    target = tiny_target("llama", seed=5)
    program = saguaro.compile(target, mode="ar", backend="eager", attention="inline", linears="reduction")
    ids, mask = prompts(1, 5, seed=6)
    program.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
    return next(
        fn for stage, fn in program.target.built_stages.items() if stage.qualified == "target.round_greedy"
    )


def test_a_stage_graph_travels_with_its_code_and_its_weights_as_metadata(monkeypatch):
    monkeypatch.setattr(graph_transport, "SMALL_TENSOR_BYTES", 1024)  # the tiny model's matrices are larger
    gm = stage_graph()
    buffer = io.BytesIO()
    torch.save(pack_graph(gm), buffer)
    packed = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    big = {k: v for k, v in packed["attributes"].items() if isinstance(v, EmptyTensor)}
    assert big and len(big) < len(packed["attributes"]), "expected both large and small attributes"
    for name, v in packed["attributes"].items():
        original = get_attribute(gm, name)
        if isinstance(v, EmptyTensor):
            assert original.untyped_storage().nbytes() > graph_transport.SMALL_TENSOR_BYTES
            assert v.parameter == isinstance(original, torch.nn.Parameter)
            assert (v.shape, v.stride, v.dtype) == (tuple(original.shape), original.stride(), original.dtype)
        elif isinstance(v, torch.Tensor):
            assert torch.equal(v, original)
    rebuilt = unpack_graph(packed)
    assert rebuilt.code == gm.code
    assert [n.name for n in rebuilt.graph.nodes] == [n.name for n in gm.graph.nodes]
    for name, p in rebuilt.named_parameters():
        assert isinstance(p, torch.nn.Parameter) and p.shape == gm.get_parameter(name).shape


def test_a_node_target_that_cannot_be_found_is_an_error_naming_it():
    with pytest.raises(ImportError, match="no_such_module.no_such_function"):
        compile_helper_target(("callable", "no_such_module.no_such_function"))


def compile_helper_target(encoded):
    return graph_transport._target(encoded)


def test_messages_frame_and_end():
    stream = io.BytesIO()
    write_message(stream, {"ok": True, "t": torch.arange(3)})
    write_message(stream, [1, 2])
    stream.write(b"\x00\x00")  # a cut-off length: the end
    stream.seek(0)
    first = read_message(stream)
    assert first["ok"] and torch.equal(first["t"], torch.arange(3))
    assert read_message(stream) == [1, 2]
    assert read_message(stream) is None


class FakeStage:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def compiled_for(self, key):
        self.log.append(("ready", self.name))

    def failed_for(self, key, exc):
        self.log.append(("failed", self.name))

    def dropped(self, key):
        pass


class FakeJob:
    """A compile job whose run waits for ``gate`` (when given) and records where it ran."""

    def __init__(self, name, log, gate=None, serves=True):
        self.stage, self.key, self.args = FakeStage(name, log), (name,), []
        self.helper, self.helper_serves, self.gate, self.log = "", serves, gate, log

    def helper_request(self):
        return {}

    def run(self):
        if self.gate is not None:
            assert self.gate.wait(30)
        self.log.append(("thread", self.stage.name, self.helper))


class FakeHelper:
    """Stands in for the helper process: records what it is sent; the test replies."""

    def __init__(self):
        self.sent, self.busy, self.dead = [], False, False

    def send(self, job):
        self.sent.append(job)
        self.busy = True

    def stop(self):
        self.dead = True


def compiler_with_fake_helper():
    compiler = BackgroundCompiler(name="test-compile")
    compiler._helper = helper = FakeHelper()
    return compiler, helper


def until(condition, seconds=30.0):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def reply(compiler, helper, job, ok):
    helper.busy = False
    compiler._helper_replied(job, ok, "test")


def test_the_helper_takes_the_next_job_while_the_thread_compiles_and_its_jobs_come_first():
    log = []
    compiler, helper = compiler_with_fake_helper()
    gate = threading.Event()
    a, b, c, d = (
        FakeJob("a", log, gate),
        FakeJob("b", log),
        FakeJob("c", log),
        FakeJob("d", log, serves=False),
    )
    compiler.submit(a)
    until(lambda: compiler._running is a)
    assert not helper.sent  # a lone job is the thread's
    for job in (b, c, d):
        compiler.submit(job)
    assert helper.sent == [b] and b.helper == "sent"  # one at a time, the first the thread has not taken
    reply(compiler, helper, b, True)  # done while the thread still compiles a
    assert helper.sent == [b, c]  # fed again at once
    gate.set()
    reply(compiler, helper, c, False)  # the helper failed c: the thread compiles it
    assert compiler.wait(30)
    ran = [entry for entry in log if entry[0] == "thread"]
    assert ran[0] == ("thread", "a", "")
    assert ("thread", "b", "done") in ran and ("thread", "c", "failed") in ran and ("thread", "d", "") in ran
    assert ran.index(("thread", "b", "done")) == 1  # the helper's finished job first
    assert d.helper == "" and len(helper.sent) == 2  # a job the helper cannot serve is never sent
    assert sorted(e[1] for e in log if e[0] == "ready") == ["a", "b", "c", "d"]
    compiler.close()
    assert helper.dead


def test_the_thread_waits_for_a_job_only_the_helper_holds():
    log = []
    compiler, helper = compiler_with_fake_helper()
    gate = threading.Event()
    a, b = FakeJob("a", log, gate), FakeJob("b", log)
    compiler.submit(a)
    until(lambda: compiler._running is a)
    compiler.submit(b)
    assert helper.sent == [b]
    gate.set()
    assert not compiler.wait(0.5)  # the thread is done with a; b is the helper's
    assert [e for e in log if e[0] == "thread"] == [("thread", "a", "")]
    reply(compiler, helper, b, True)
    assert compiler.wait(30)
    assert [e for e in log if e[0] == "thread"] == [("thread", "a", ""), ("thread", "b", "done")]
    compiler.close()


def test_a_helper_that_dies_fails_its_jobs_and_the_thread_compiles_them():
    replies = []
    helper = CompileHelper(lambda job, ok, detail: replies.append((job, ok, detail)))
    helper._proc = type("Gone", (), {"poll": lambda self: 1})()
    helper._outbox.append("queued")
    helper._sent.append("sent")
    helper._fail("exited with code 1")
    assert helper.dead and not helper.busy
    assert [(job, ok) for job, ok, _ in replies] == [("sent", False), ("queued", False)]
    assert "exited with code 1" in replies[0][2]
    with pytest.raises(RuntimeError, match="not running"):
        helper.send("later")


@pytest.mark.heavy
def test_a_helper_process_fills_the_caches_the_compile_thread_reads_and_tokens_stay_exact(
    monkeypatch, tmp_path
):
    monkeypatch.setenv(compile_helper.HELPER_ENV, "1")
    # an empty Inductor cache (the helper inherits it): a hit below can only be what the helper wrote
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(compile_helper.os, "cpu_count", lambda: 2)
    target = tiny_target("llama", seed=7)
    draft = truncated_draft(target)
    ids, mask = prompts(1, 9, seed=8)
    expected = reference_greedy(target, ids, mask, 8)
    program = saguaro.compile(target, draft, k=3, backend="inductor", compile="background")
    compiler = program.target.build.compiler
    done = []
    replied = compiler._helper_replied
    monkeypatch.setattr(
        compiler,
        "_helper_replied",
        lambda job, ok, detail: (done.append((job.stage.name, ok)), replied(job, ok, detail)),
    )
    compiler._helper._on_reply = compiler._helper_replied
    hits = counters["aot_autograd"]["autograd_cache_hit"] + counters["inductor"]["fxgraph_cache_hit"]
    try:
        first = program.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None, mode="sd")
        assert torch.equal(first.sequences, expected)
        assert program.wait_compiled(timeout=540)
        assert any(ok for _, ok in done), f"the helper compiled no stage: {done}"
        assert (
            counters["aot_autograd"]["autograd_cache_hit"] + counters["inductor"]["fxgraph_cache_hit"] > hits
        )
        second = program.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None, mode="sd")
        assert torch.equal(second.sequences, expected)
    finally:
        program.close()
    assert compiler._helper._proc is None  # close stopped it; a fresh helper starts with the next job fed


SETUP_CALLS = []


def record_setup():
    SETUP_CALLS.append("called")


def test_a_request_s_setup_functions_run_before_its_graph_is_read(monkeypatch):
    from saguaro.lower import compile_helper_main

    order = []
    monkeypatch.setattr(
        compile_helper_main, "unpack_graph", lambda packed: order.append(list(SETUP_CALLS)) or 1 / 0
    )
    SETUP_CALLS.clear()
    with pytest.raises(ZeroDivisionError):
        compile_helper_main.compile_request({"graph": None, "setup": (f"{__name__}:record_setup",)})
    assert order == [["called"]]  # the library the graph calls is loaded before the graph is read
