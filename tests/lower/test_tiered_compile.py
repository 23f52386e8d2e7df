"""Tiered compilation (``compile="background"``, ``saguaro/lower/tiered.py``): a stage runs its eager form
while one background thread compiles it for the call's shapes, then its compiled form; tokens are the
target's greedy tokens throughout. Two real Inductor compiles (AR's prefill and step); the SD and failure
tests stand a counting GraphModule in for the compiled form, so they exercise the switching itself."""

import importlib
import io
import logging
import threading
import time

import pytest
import torch
from torch._dynamo.utils import counters

import saguaro
from saguaro.cli.generate import CompileProgress
from saguaro.cli.main import main
from saguaro.core.config import SaguaroConfig
from saguaro.core.errors import ConfigError
from saguaro.core.stages import TARGET_PREFILL, TARGET_ROUND, TARGET_VERIFY, stages_for
from saguaro.lower.tiered import TieredStage
from saguaro.passes.linear_as_reduction import LINEAR
from saguaro.runtime.generation_plan import COMPILING
from tests.models import prompts, reference_greedy, tiny_target, truncated_draft

pytestmark = pytest.mark.heavy  # one test compiles with Inductor; the others capture tiny models
NEW = 8


def tiers(program) -> dict:
    """``{stage name: (eager calls, compiled calls)}`` of every stage built so far."""
    out = {}
    for runner in (program.target, program.draft):
        for stage, fn in (runner.built_stages if runner is not None else {}).items():
            assert isinstance(fn, TieredStage), f"{stage.qualified} is not tiered: {type(fn).__name__}"
            out[stage.qualified] = (fn.eager_calls, fn.compiled_calls)
    return out


COMPILE_THREAD = "saguaro-compile"


class Spy:
    """Calls ``fn`` and keeps each call's thread and tensors (alive, so no storage is reused); on the
    compile thread it first waits for ``gate`` and raises when ``fail``. Stands in for a compiled form
    (``compile_s`` and ``output_code`` as a CompiledStage has them) or records the eager form's calls."""

    def __init__(self, fn, fail: bool = False, gate: threading.Event | None = None):
        self.fn, self.fail, self.gate = fn, fail, gate
        self.compile_s, self.output_code = None, []
        self.calls = []  # (thread name, [tensors])

    def __call__(self, *args):
        thread = threading.current_thread().name
        self.calls.append((thread, [a for a in args if isinstance(a, torch.Tensor)]))
        if thread == COMPILE_THREAD:
            if self.gate is not None:
                self.gate.wait(30)
            if self.fail:
                raise RuntimeError("inductor fell over")
        return self.fn(*args)

    def compiles(self) -> int:
        return sum(thread == COMPILE_THREAD for thread, _ in self.calls)

    def storages(self, compile_thread: bool) -> set:
        return {
            t.untyped_storage().data_ptr()
            for thread, tensors in self.calls
            if (thread == COMPILE_THREAD) == compile_thread
            for t in tensors
        } - {0}


def spy_on(program, mode: str, fail=(), gate=None) -> dict:
    """Build ``mode``'s stages; each one's compiled form becomes a :class:`Spy` over its GraphModule
    (no Inductor), its eager form a Spy too. ``{stage name: (eager spy, compiled spy)}``."""
    program.prepare(mode, 0.0)
    out = {}
    for stage in stages_for(mode, 0.0):
        fn = program.runner(stage.model).stage(stage)
        fn.compiled = Spy(fn.gm, fail=stage.qualified in fail, gate=gate)
        fn.gm = Spy(fn.gm)
        out[stage.qualified] = (fn.gm, fn.compiled)
    return out


def test_compile_option_is_validated_and_fixed_after_compile():
    with pytest.raises(
        ConfigError, match=r"compile='lazy' is not allowed: choose one of blocking, background"
    ):
        SaguaroConfig(compile="lazy")
    with pytest.raises(ConfigError, match=r"compile=True is not allowed"):
        saguaro.compile(tiny_target("llama"), mode="ar", compile=True)
    assert (
        SaguaroConfig().compile == "blocking"
    )  # benchmarks and seeded sampling: never eager-while-compiling


@pytest.mark.timeout(600)  # two Inductor compiles of a tiny Llama, 10-40 s each on a loaded 2-core CPU
def test_ar_runs_eager_at_once_then_compiled_with_the_same_tokens():
    target = tiny_target("llama")
    ids, mask = prompts(2, 7, seed=3, pad_rows={1: 2})
    expected = reference_greedy(target, ids, mask, NEW)
    program = saguaro.compile(target, mode="ar", backend="inductor", compile="background")
    try:
        first = program.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None)
        assert torch.equal(first.sequences, expected)
        before = tiers(program)
        assert set(before) == {TARGET_PREFILL.qualified, TARGET_ROUND.qualified}  # greedy AR's round
        assert before[TARGET_PREFILL.qualified] == (
            1,
            0,
        )  # a new shape's first call never waits for a compile
        assert before[TARGET_ROUND.qualified][0] >= 1
        # the round is packed (pack_linears), its eager form the same graph: the kernel runs eager as fast
        step = program.target.stage(TARGET_ROUND)
        linears = lambda gm: sum(n.target is LINEAR for n in gm.graph.nodes)
        assert linears(step.gm) == 0 and step.gm is step.compiled.gm
        assert program.wait_compiled(timeout=540)
        graphs = counters["stats"]["unique_graphs"]
        second = program.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None)
        assert torch.equal(second.sequences, expected)
        after = tiers(program)
        for name, (eager, compiled) in after.items():
            assert eager == before[name][0], f"{name} ran eager after its compile finished"
            assert compiled > before[name][1], f"{name} never ran compiled"
        # the compile thread replayed the call's shapes, strides and modes: nothing compiled on the caller's
        assert counters["stats"]["unique_graphs"] == graphs
    finally:
        program.close()


def background_pair(**options):
    """``(program, ids, mask, expected)``: a tiny pair compiled with ``compile="background"`` (k=3), a
    prompt and the target's greedy tokens for it."""
    target = tiny_target("llama", seed=1)
    draft = truncated_draft(target)
    ids, mask = prompts(1, 9, seed=4)
    expected = reference_greedy(target, ids, mask, NEW)
    program = saguaro.compile(target, draft, k=3, backend="inductor", compile="background", **options)
    return program, ids, mask, expected


def test_sd_switches_each_stage_when_its_compile_finishes_and_never_lends_it_live_tensors():
    program, ids, mask, expected = background_pair(mode="sd", sd_when_faster=False)
    try:
        gate = threading.Event()  # the compile thread holds its first job until the first generation ends
        forms = spy_on(program, "sd", gate=gate)
        first = program.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None)
        assert torch.equal(first.sequences, expected)
        before = tiers(program)
        assert all(eager >= 1 and compiled == 0 for eager, compiled in before.values()), before
        gate.set()
        assert program.wait_compiled(timeout=60)
        assert tiers(program) == before
        assert all(compiled.compiles() == len(compiled.calls) >= 1 for _, compiled in forms.values())
        second = program.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None)
        assert torch.equal(second.sequences, expected)
        for name, (eager, compiled) in tiers(program).items():
            assert eager == before[name][0] and compiled > 0, (name, eager, compiled)
            eager_spy, compiled_spy = forms[name]
            live = eager_spy.storages(False) | compiled_spy.storages(False)
            scratch = compiled_spy.storages(True)
            assert live and scratch and not live & scratch, f"{name}: the compile thread ran on live tensors"
    finally:
        program.close()


def test_ssd_runs_sd_while_its_stages_compile_then_times_ssd_on_compiled_stages():
    program, ids, mask, expected = background_pair(mode="ssd", lane="thread", fan_out="geometric")
    try:
        gate = threading.Event()  # the compile thread holds its first job until the test lets it go
        forms = spy_on(program, "ssd", gate=gate)
        for _ in range(2):  # the shape's first call, then a call while compiles are still queued
            out = program.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None)
            assert torch.equal(out.sequences, expected)
            assert (out.stats["ran_as"], out.stats["plan"], out.stats["planned_sd"]) == (
                "sd",
                COMPILING,
                False,
            )
            assert program.lanes._client is None, "a lane started while SSD's costs could not be measured"
            assert not program.calibration._costs, "costs were measured on stages still compiling"
        gate.set()
        assert program.wait_compiled(timeout=60)
        tree = next(name for name in forms if "tree" in name)
        out = program.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None)
        assert torch.equal(out.sequences, expected)
        assert out.stats["plan"] != COMPILING and program.calibration._costs  # measured now, SSD or SD chosen
        # the warm-up's first tree calls ran eager and queued compiles: its costs were timed again compiled
        assert forms[tree][1].compiles() >= 1 and len(forms[tree][1].calls) > forms[tree][1].compiles()
    finally:
        gate.set()
        program.close()


def test_a_failed_background_compile_warns_once_and_the_stage_stays_eager(caplog):
    target = tiny_target("llama", seed=2)
    program = saguaro.compile(target, mode="ar", backend="inductor", compile="background")
    try:
        forms = spy_on(program, "ar", fail={TARGET_PREFILL.qualified})
        with caplog.at_level(logging.WARNING, logger="saguaro.lower.tiered"):
            for length in (7, 20):  # two prompt buckets: the prefill fails to compile twice
                ids, mask = prompts(1, length, seed=length)
                for _ in range(2):
                    out = program.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None)
                    assert torch.equal(out.sequences, reference_greedy(target, ids, mask, NEW))
                    assert program.wait_compiled(timeout=60)
        warnings = [r for r in caplog.records if r.name == "saguaro.lower.tiered"]
        assert len(warnings) == 1 and TARGET_PREFILL.qualified in warnings[0].getMessage(), warnings
        assert "inductor fell over" in warnings[0].getMessage()
        assert forms[TARGET_PREFILL.qualified][1].compiles() == 2  # once per bucket, never again
        counts = tiers(program)
        assert counts[TARGET_PREFILL.qualified] == (4, 0)
        assert counts[TARGET_ROUND.qualified][1] > 0  # the other stage switched
    finally:
        program.close()


def test_close_drops_queued_compiles_and_a_later_call_queues_them_again():
    target = tiny_target("llama", seed=2)
    program = saguaro.compile(target, mode="ar", backend="inductor", compile="background")
    gate = threading.Event()
    try:
        forms = spy_on(
            program, "ar", gate=gate
        )  # the compile thread holds its first job until the gate opens
        ids, mask = prompts(1, 7, seed=5)
        program.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None)
        assert not program.wait_compiled(timeout=0.05)
        compiler = program.target.build.compiler
        assert compiler.pending == 2  # prefill compiling (held at the gate), step queued
        closer = threading.Thread(target=program.close)
        closer.start()
        deadline = time.monotonic() + 30
        while compiler.pending != 1 and time.monotonic() < deadline:  # close() dropped the queued step
            time.sleep(0.01)
        assert closer.is_alive()  # waiting for the compile under way
        gate.set()
        closer.join(timeout=30)
        assert not closer.is_alive() and compiler.pending == 0
        assert [compiled.compiles() for _, compiled in forms.values()] == [1, 0]
        program.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None)
        assert program.wait_compiled(timeout=60)
        assert [compiled.compiles() for _, compiled in forms.values()] == [
            1,
            1,
        ]  # the dropped one queued again
    finally:
        gate.set()
        program.close()


def test_compile_blocking_keeps_the_compiled_stages_and_compiles_new_shapes_on_the_caller():
    target = tiny_target("llama", seed=2)
    ids, mask = prompts(1, 7, seed=5)
    expected = reference_greedy(target, ids, mask, NEW)
    program = saguaro.compile(target, truncated_draft(target), k=3, backend="inductor", compile="background")
    try:
        forms = spy_on(program, "ar")  # the stages built so far: tiered, each form a spy (no Inductor)
        program.compile_blocking()
        assert program.config.compile == "blocking" and program.target.build.compiler is None
        out = program.generate(ids, attention_mask=mask, max_new_tokens=NEW, mode="ar", eos_token_id=None)
        assert torch.equal(out.sequences, expected)
        for name, (eager, compiled) in forms.items():  # new shapes compiled where they were called, not eager
            assert not eager.calls, f"{name} ran eager after compile_blocking"
            assert compiled.calls and not compiled.compiles(), name
        verify = program.target.stage(TARGET_VERIFY.greedy)  # built after it: no background compiler
        assert not isinstance(verify, TieredStage)
    finally:
        program.close()


@pytest.mark.parametrize("flags,expected", [([], "background"), (["--compile", "blocking"], "blocking")])
def test_saguaro_generate_compiles_in_the_background_unless_told_to_block(flags, expected, monkeypatch):
    class Compiled(Exception):
        pass

    def stand_in(*args, **options):
        raise Compiled(options.get("compile"))

    monkeypatch.setattr(importlib.import_module("saguaro.compile"), "compile", stand_in)
    pair = (None, None, object())  # target, draft, tokenizer: never used, the stand-in raises first
    monkeypatch.setattr(importlib.import_module("saguaro.models_io"), "load_pair", lambda *a, **k: pair)
    with pytest.raises(Compiled) as compiled:
        main(["generate", "--prompt", "def f(x):", *flags])
    assert compiled.value.args == (expected,)


def test_progress_draws_a_line_per_stage_until_the_text_starts():
    def event(kind, stage, seconds=0.0):
        return logging.makeLogRecord(
            {
                "levelno": logging.INFO,
                "levelname": "INFO",
                "msg": kind,
                "compile_event": kind,
                "stage": stage,
                "seconds": seconds,
            }
        )

    screen = io.StringIO()
    progress = CompileProgress(screen)
    try:
        progress.handle(event("start", "target.prefill"))
        assert "compiling target.prefill" in screen.getvalue()
        progress.handle(event("done", "target.prefill", 12.34))
        assert "compiled target.prefill in 12.3s" in screen.getvalue()
        progress.handle(event("start", "target.step"))
        progress.mute()  # the completion starts: nothing more on the screen
        drawn = screen.getvalue()
        progress.handle(event("done", "target.step", 2.0))
        progress.handle(event("start", "draft.prefill"))
        assert screen.getvalue() == drawn
        summary = (
            "inductor: compiled target.prefill in 12.3s, target.step in 2.0s; still compiling draft.prefill"
        )
        assert progress.summary() == summary
    finally:
        progress.close()
