"""The background compiler's hold: ``saguaro.compile(compile="background")`` keeps the compile thread's jobs
queued until the first generation's first round is out (a compile holds the GIL for long stretches and
would slow the eager rounds that make the first text); a blocking wait and close release it; a probe
(``wait(timeout=0)``) does not."""

import threading

import saguaro
from saguaro.lower.compile_thread import BackgroundCompiler
from tests.models import prompts, reference_greedy, tiny_target


class Job:
    def __init__(self):
        self.stage, self.key, self.args = self, ("shape",), []
        self.ran = threading.Event()
        self.done: list = []

    def run(self):
        self.ran.set()

    def compiled_for(self, key):
        self.done.append(key)

    def failed_for(self, key, exc):
        raise AssertionError(exc)

    def dropped(self, key):
        self.done.append(("dropped", key))


def test_a_held_compiler_runs_nothing_until_released():
    compiler = BackgroundCompiler(held=True)
    job = Job()
    compiler.submit(job)
    assert compiler.pending == 1 and not job.ran.is_set()  # the thread is up but waits
    assert compiler.wait(timeout=0) is False and compiler.held  # a probe neither waits nor releases
    compiler.release()
    assert compiler.wait(timeout=30) and job.done == [("shape",)]


def test_a_blocking_wait_releases_and_close_ends_a_waiting_thread():
    compiler = BackgroundCompiler(held=True)
    job = Job()
    compiler.submit(job)
    assert compiler.wait(timeout=30) and job.ran.is_set() and not compiler.held
    held = BackgroundCompiler(held=True)
    other = Job()
    held.submit(other)
    thread = held._thread
    held.close(timeout=30)
    assert not thread.is_alive() and other.done == [("dropped", ("shape",))] and not other.ran.is_set()


def test_a_program_holds_its_compiles_through_the_prefill_and_releases_them_at_the_first_round():
    target = tiny_target("llama", seed=1)
    ids, mask = prompts(1, 9, seed=4)
    program = saguaro.compile(target, mode="ar", backend="inductor", compile="background")
    compiler = program.target.build.compiler
    seen = []
    try:
        program.prepare("ar", 0.0)
        for fn in program.target.built_stages.values():
            fn.compiled = fn.gm  # the graph itself stands in for Inductor's form: no compile to wait for
        prefill = next(
            fn for stage, fn in program.target.built_stages.items() if stage.qualified == "target.prefill"
        )
        eager = prefill.gm

        def watched(*args):  # the prefill runs eager while its compile waits, held
            seen.append(("prefill", compiler.held, compiler.pending))
            return eager(*args)

        prefill.gm = watched
        out = program.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=3,
            eos_token_id=None,
            on_round=lambda chunk: seen.append(("round", compiler.held)),
        )
        assert seen[0] == ("prefill", True, 1) and seen[1] == ("round", False), (
            seen
        )  # its compile queued, held
        assert out.sequences.equal(reference_greedy(target, ids, mask, 3))
    finally:
        program.close()
