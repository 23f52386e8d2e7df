"""The process lane: the draft server in a child process started through Saguaro's own entry point.

The draft travels as files (:mod:`.draft_files`), messages as pickles over an anonymous socket pair
(docs/design.md, "How data flows"): ``(seq, method, args, reply?)`` out, ``(seq, ok, value, events)``
back with the draft's trace events since its last reply. Whole messages under deferred SIGINT and
dropped stale replies keep the lane in step after Ctrl-C. The child watches ``getppid`` rather than
``PR_SET_PDEATHSIG``, which fires when the starting *thread* exits."""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from multiprocessing.connection import Connection

import torch

from saguaro.core.config import SaguaroConfig
from saguaro.core.errors import SaguaroError
from saguaro.runtime.base.trace import traced
from saguaro.runtime.lanes.protocol import DraftLaneError, Method

log = logging.getLogger(__name__)

CLOSE = "close"  # the message that ends the draft process
INIT = "init"  # the first message: the draft's description, the config, the caller's sys.path
POLL_S = 0.1  # reply waits poll this often, so an interrupt is noticed promptly
_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 3))  # holds saguaro/
_BOOT = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); sys.path.insert(0, sys.argv[1]); "
    "import importlib; sys.exit(importlib.import_module(sys.argv[2]).main(sys.argv[3:]))"
)


@contextmanager
def uninterrupted():
    """Defer SIGINT on the main thread until the block ends, then deliver it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        if pending:
            signal.raise_signal(signal.SIGINT)  # delivered now, to the caller's own handler


def send(conn: Connection, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    with uninterrupted():
        conn.send_bytes(data)


def serve(conn: Connection, server) -> None:
    """The draft process's loop: run each message's method in order, reply to calls; a posted method's
    exception is answered to the next call, and ``open`` starts afresh."""
    failure = None
    with torch.inference_mode():
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                return  # the caller closed the lane or died
            with traced(server.draft.recorder, "draft", "recv"):  # transport: from arrival to the object
                seq, method, args, reply = pickle.loads(data)
            if method == CLOSE:
                return
            try:
                if not isinstance(method, Method):
                    raise DraftLaneError(f"not a draft server method: {method!r}")
                if failure is not None and method is not Method.OPEN:
                    raise failure
                failure = None
                result = method.bound_to(server)(*args)
            except Exception as exc:
                failure = exc
                if reply:
                    send(conn, (seq, False, f"{type(exc).__name__}: {exc}", _events(server)))
                continue
            if reply:
                recorder = server.draft.recorder
                if recorder is None:
                    send(conn, (seq, True, result, None))
                    continue
                with traced(recorder, "draft", f"send {method.value}"):  # serialising the result
                    payload = pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL)
                send(conn, (seq, True, _Pickled(payload), _events(server)))


class _Pickled:
    """A reply value pickled beforehand (its ``send`` slice ends before the events travel)."""

    __slots__ = ("payload",)

    def __init__(self, payload: bytes):
        self.payload = payload


def _events(server) -> dict | None:
    """The draft side's trace events since the last reply (None when it is not recording)."""
    recorder = server.draft.recorder
    return None if recorder is None else recorder.take()


DRAFT_ENTRY_POINT = "saguaro.runtime.lanes.draft_process"  # the module the draft process runs
CLOSE_WAIT_S = 2.0  # how long close() waits for the draft process to exit before killing it


class ProcessLane:
    """The draft server in a child process; started once per Program and reused across calls."""

    recorder = None  # a runtime.trace.TraceRecorder while a traced generate runs: transport slices

    kind = "process"

    def __init__(self, remote_draft, config: SaguaroConfig, start_timeout_s: float, timeout_s: float):
        """Write the draft with ``remote_draft.save(directory)``, start the child and wait for its server.
        ``DraftLaneError`` when it cannot start; an interrupt kills and reaps the child first."""
        self.timeout_s = timeout_s
        self.process: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._seq = 0
        self._trace_parts: list[dict] = []  # the draft process's events that came back with replies
        started = time.perf_counter()
        directory = tempfile.mkdtemp(prefix="saguaro-draft-")  # 0700: private to this user
        try:
            try:
                description = remote_draft.save(directory)
                self._spawn(DRAFT_ENTRY_POINT)
            except SaguaroError as exc:  # a class the draft process cannot import, named
                raise DraftLaneError(str(exc)) from exc
            except Exception as exc:
                raise DraftLaneError(f"{type(exc).__name__}: {exc}") from exc
            self._request(INIT, (description, config, list(sys.path)), start_timeout_s, "start-up")
        except BaseException:
            self._stop()
            raise
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        log.info("draft process lane up in %.1fs (pid %d)", time.perf_counter() - started, self.process.pid)

    @property
    def pid(self) -> int:
        return self.process.pid

    def _spawn(self, entry_point: str) -> None:
        if not sys.executable or os.name != "posix":
            raise DraftLaneError("the process lane needs a POSIX system and sys.executable")
        ours, theirs = socket.socketpair()
        self._conn = Connection(ours.detach())
        try:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-P",
                    "-c",
                    _BOOT,
                    _ROOT,
                    entry_point,
                    str(theirs.fileno()),
                    str(os.getpid()),
                ],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()

    def _dead(self) -> DraftLaneError:
        try:
            code = self.process.wait(timeout=1)
        except subprocess.TimeoutExpired:
            code = None
        return DraftLaneError(f"draft process {self.process.pid} is dead (exit code {code})")

    def _request(self, method, args: tuple, timeout_s: float, what: str):
        self._seq += 1
        seq = self._seq
        try:
            with traced(self.recorder, "host", f"send {what}"):
                send(self._conn, (seq, method, args, True))
        except OSError as exc:
            raise self._dead() from exc
        deadline = time.monotonic() + timeout_s
        while True:
            while not self._conn.poll(POLL_S):  # readable at end-of-file too: a dead child is seen at once
                if self.process.poll() is not None:
                    raise self._dead()
                if time.monotonic() > deadline:
                    raise DraftLaneError(f"draft lane gave no answer to {what} within {timeout_s:.1f}s")
            try:
                with uninterrupted():
                    data = self._conn.recv_bytes()
            except (EOFError, OSError) as exc:
                raise self._dead() from exc
            with traced(self.recorder, "host", "recv"):
                got, ok, value, events = pickle.loads(data)
                if isinstance(value, _Pickled):
                    value = pickle.loads(value.payload)
            if events is not None and events["events"]:
                self._trace_parts.append(events)
            if got != seq:
                continue  # the answer to a call an interrupt abandoned
            if not ok:
                raise DraftLaneError(f"draft lane failed in {what}: {value}")
            return value

    def post(self, method: Method, *args) -> None:
        """Send ``server.method(*args)``; it runs in the draft process while the caller goes on."""
        if self.process.poll() is not None:
            raise self._dead()
        self._seq += 1
        try:
            with traced(self.recorder, "host", f"send {method.value}"):
                send(self._conn, (self._seq, method, args, False))
        except OSError as exc:
            raise self._dead() from exc

    def call(self, method: Method, *args, timeout_s: float | None = None):
        """Run ``server.method(*args)`` after what was posted and return its result, within ``timeout_s``
        (default: the lane's)."""
        return self._request(method, args, self.timeout_s if timeout_s is None else timeout_s, method.value)

    def settle(self) -> None:
        """Nothing to wait for here: the draft process's unneeded build ends on its own."""

    def take_trace(self) -> list[dict]:
        """The draft process's events as they came back with the replies; recording stops (posted: its last,
        unneeded build is not waited for)."""
        self.post(Method.TRACE_TAKE)
        parts, self._trace_parts = self._trace_parts, []
        return parts

    def close(self) -> None:
        """Ask the draft process to exit, kill it after :data:`CLOSE_WAIT_S`, reap it."""
        if self.process is not None and self.process.poll() is None and self._conn is not None:
            try:
                send(self._conn, (self._seq + 1, CLOSE, (), False))
                self.process.wait(timeout=CLOSE_WAIT_S)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._stop()

    def _stop(self) -> None:
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            self.process.wait()  # reaped: no defunct child
        if self._conn is not None:
            self._conn.close()
            self._conn = None
