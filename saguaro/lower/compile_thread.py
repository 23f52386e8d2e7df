"""The one thread that compiles a Program's stages in the background (``compile="background"``,
:mod:`saguaro.lower.tiered`): jobs run in the order queued, and the thread ends when the interpreter
exits without holding it up or aborting it. With a compile helper (a second process,
:mod:`saguaro.lower.compile_helper`), the helper compiles the next queued job while the thread compiles
one; the thread then compiles the helper's jobs from Inductor's caches, first among the jobs queued."""

from __future__ import annotations

import ctypes
import logging
import threading
import weakref
from collections import deque
from typing import Protocol

from saguaro.lower.compile_helper import CompileHelper

log = logging.getLogger(__name__)
_COMPILERS: weakref.WeakSet = weakref.WeakSet()  # the compilers whose thread the exit hook ends
_EXIT_HOOK = threading.Event()  # set once _exit_all is registered


class Job(Protocol):
    """What the thread runs: ``run()`` compiles, then ``stage.compiled_for(key)`` or, when it raised,
    ``stage.failed_for(key, exc)``; a job dropped unrun tells ``stage.dropped(key)``. ``args`` are let go
    once it has run (:class:`~saguaro.lower.tiered.CompileJob`)."""

    stage: object
    key: tuple
    args: list
    helper: str  # "" not sent to a compile helper, "sent", "done" (its caches are written), "failed"
    helper_serves: bool  # whether a compile helper can compile it

    def helper_request(self) -> dict | None: ...

    def run(self) -> None: ...


class Cancelled(BaseException):
    """Raised in the compile thread when the interpreter exits, to end the compile under way."""


class BackgroundCompiler:
    """The one thread that compiles a Program's stages in the background (its target's and draft's
    alike), one job at a time, in the order queued; the thread lives while there is work. :meth:`close`
    drops what is queued and waits for the compile under way. At the interpreter's exit (before it joins
    its threads) the queue is dropped and the compile under way is ended by raising :class:`Cancelled`
    in the thread: a thread left inside torch's C++ code while Python 3.11 finalizes aborts the process
    (a daemon thread would), and waiting for the compile could take tens of seconds.

    ``helper``: compile with a helper process too (:class:`~saguaro.lower.compile_helper.CompileHelper`,
    started with the first job it takes). It gets a job only while the thread compiles another, one at a
    time; the thread takes the jobs the helper is done with first, then the others in order (a job the
    helper failed included), and waits for the helper only when it holds every job left."""

    def __init__(self, name: str = "saguaro-compile", held: bool = False, helper: bool = False):
        self.name = name
        self._helper = CompileHelper(self._helper_replied) if helper else None
        self._jobs: deque = deque()
        self._cond = threading.Condition()
        self._running: Job | None = None
        self._thread: threading.Thread | None = None
        self._exiting = False
        self._held = held

    def start_helper(self) -> None:
        """Start the compile helper (if this compiler has one) before the first job it takes."""
        if self._helper is not None:
            self._helper.start()

    @property
    def held(self) -> bool:
        return self._held

    def release(self) -> None:
        """Let queued jobs run. ``held=True`` keeps them queued until then (``saguaro.compile`` releases
        its compiler when the first generation's first round is out: a compile holds the GIL for long
        stretches, and the eager rounds that make the first text wait for it; measured on the 2-core CPU,
        the demo's first text came 1.5-2 s later without the hold). A blocking :meth:`wait` and
        :meth:`close` release it too."""
        with self._cond:
            self._held = False
            self._cond.notify_all()

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._exiting:
                return
            self._jobs.append(job)
            self._feed_helper()
            if self._thread is None:  # idle, or closed: a fresh thread
                # not a daemon (a thread inherits its creator's flag: a stream's worker is one), so the
                # interpreter's exit joins it after the exit hook has ended its compile
                self._thread = threading.Thread(target=self._work, name=self.name, daemon=False)
                _end_at_exit(self)
                self._thread.start()
            self._cond.notify_all()

    def _work(self) -> None:
        try:
            self._loop()
        except Cancelled:  # the interpreter is exiting
            pass

    def _loop(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                while self._held and self._jobs and self._thread is me and not self._exiting:
                    self._cond.wait()
                if self._thread is not me or not self._jobs:  # closed, or no work left
                    if self._thread is me:
                        self._thread = None
                    return
                job = self._next_job()
                if job is None:  # the helper holds every job left
                    self._cond.wait()
                    continue
                self._jobs.remove(job)
                self._running = job
                self._feed_helper()
            try:
                job.run()
                job.stage.compiled_for(job.key)
            except Exception as exc:  # noqa: BLE001 - any failure leaves the stage eager for these shapes
                if not self._exiting:  # else the interpreter's exit ended it
                    job.stage.failed_for(job.key, exc)
            finally:
                job.args = []
                with self._cond:
                    if self._running is job:
                        self._running = None
                    self._cond.notify_all()

    def _next_job(self):
        """The job the thread compiles next (under the lock): one the helper is done with, else the first
        the helper does not hold; None when it holds them all."""
        for job in self._jobs:
            if getattr(job, "helper", "") == "done":
                return job
        return next((job for job in self._jobs if getattr(job, "helper", "") != "sent"), None)

    def _feed_helper(self) -> None:
        """Hand the helper the first job it can compile and nobody has taken (under the lock), while the
        thread compiles another: a lone job compiles faster on the thread than through the helper."""
        helper = self._helper
        if helper is None or helper.dead or helper.busy or self._held or self._exiting or self._running is None:
            return
        job = next((j for j in self._jobs if getattr(j, "helper", None) == "" and j.helper_serves), None)
        if job is not None:
            log.info("compile helper takes stage %s", getattr(job.stage, "name", "?"))
            job.helper = "sent"
            try:
                helper.send(job)
            except (OSError, RuntimeError):  # it could not start, or has stopped
                job.helper = "failed"

    def _helper_replied(self, job, ok: bool, detail: str) -> None:
        with self._cond:
            job.helper = "done" if ok else "failed"
            if ok:
                log.info("compile helper compiled stage %s (%s)", getattr(job.stage, "name", "?"), detail)
            else:
                log.info("compile helper could not compile stage %s (%s); the compile thread will",
                         getattr(job.stage, "name", "?"), detail)
            self._feed_helper()
            self._cond.notify_all()

    def _exit(self) -> None:
        """At the interpreter's exit: drop the queue and end the compile under way."""
        with self._cond:
            self._exiting = True
            self._jobs.clear()
            thread, running = self._thread, self._running
            self._cond.notify_all()
        if self._helper is not None:
            self._helper.stop()
        if thread is not None and running is not None and thread.ident is not None:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(Cancelled))

    @property
    def pending(self) -> int:
        """Compiles queued or under way."""
        with self._cond:
            return len(self._jobs) + (self._running is not None)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or compiling: True, or False when ``timeout`` seconds passed first.
        A wait that may block (``timeout`` None or above 0) releases a hold first."""
        if timeout is None or timeout > 0:
            self.release()
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and self._running is None, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Drop the queued compiles (their stages queue them again on their next call), stop the thread
        and the compile helper, and wait up to ``timeout`` seconds for the compile under way. A later job
        starts a new thread (and a new helper, when it is fed one)."""
        with self._cond:
            dropped, thread = list(self._jobs), self._thread
            self._held = False
            self._jobs.clear()
            self._thread = None
            self._cond.notify_all()
        if self._helper is not None:
            self._helper.stop()
            self._helper = CompileHelper(self._helper_replied)
        for job in dropped:
            job.stage.dropped(job.key)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)


def _end_at_exit(compiler: BackgroundCompiler) -> None:
    """Have the interpreter's exit end ``compiler``'s thread (threading's exit hooks run before it joins
    the threads left); the hook is registered once, with the first compile thread."""
    if not _EXIT_HOOK.is_set():
        try:
            threading._register_atexit(_exit_all)  # what concurrent.futures uses for its workers
        except RuntimeError:  # the interpreter is exiting already
            return
        _EXIT_HOOK.set()
    _COMPILERS.add(compiler)


def _exit_all() -> None:
    for compiler in list(_COMPILERS):
        compiler._exit()
