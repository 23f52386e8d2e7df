"""The one thread that compiles a Program's stages in the background (``compile="background"``), in order.

With a compile helper (:mod:`saguaro.lower.compile_helper`) the helper takes the next job while the thread
compiles one; the thread then takes the helper's jobs (from Inductor's caches) first."""

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
    """What the thread runs: ``run()``, then ``stage.compiled_for(key)``, or ``stage.failed_for(key, exc)``
    if it raised; a job dropped unrun gets ``stage.dropped(key)``. ``args`` are let go once it ran."""

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
    """One thread compiling jobs in order, alive while there is work; ``held``: jobs wait for :meth:`release`;
    ``helper``: a :class:`~saguaro.lower.compile_helper.CompileHelper` takes one job at a time beside it. At
    the interpreter's exit the queue is dropped and the compile under way ended by raising :class:`Cancelled`
    in the thread (one left in torch's C++ code while Python finalizes aborts the process)."""

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
        """Let queued jobs run (``saguaro.compile`` holds them until the first round is out: a compile holds
        the GIL the eager first rounds need). A blocking :meth:`wait` and :meth:`close` release too."""
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
                # not a daemon (a stream's worker is one, and a thread inherits the flag): the interpreter's
                # exit joins it after the exit hook ended its compile
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
            except Exception as exc:
                if not self._exiting:  # else the interpreter's exit ended it
                    job.stage.failed_for(job.key, exc)
            finally:
                job.args = []
                with self._cond:
                    if self._running is job:
                        self._running = None
                    self._cond.notify_all()

    def _next_job(self):
        """Under the lock: a job the helper is done with, else the first it does not hold; else None."""
        for job in self._jobs:
            if getattr(job, "helper", "") == "done":
                return job
        return next((job for job in self._jobs if getattr(job, "helper", "") != "sent"), None)

    def _feed_helper(self) -> None:
        """Under the lock, while the thread compiles one: hand the helper the first job it can take."""
        helper = self._helper
        if (
            helper is None
            or helper.dead
            or helper.busy
            or self._held
            or self._exiting
            or self._running is None
        ):
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
                log.info(
                    "compile helper could not compile stage %s (%s); the compile thread will",
                    getattr(job.stage, "name", "?"),
                    detail,
                )
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
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(thread.ident), ctypes.py_object(Cancelled)
            )

    @property
    def pending(self) -> int:
        """Compiles queued or under way."""
        with self._cond:
            return len(self._jobs) + (self._running is not None)

    def wait(self, timeout: float | None = None) -> bool:
        """True once nothing is queued or compiling, False after ``timeout`` seconds. A wait that may block
        (``timeout`` None or above 0) releases a hold first."""
        if timeout is None or timeout > 0:
            self.release()
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and self._running is None, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Drop the queued jobs (their stages queue them again), stop the thread and the helper, and wait up
        to ``timeout`` seconds for the compile under way; a later job starts a new thread."""
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
    """Have the interpreter's exit end ``compiler``'s thread (threading's exit hook, registered once)."""
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
