"""Ctrl-C ends a serving process promptly, even while its main thread waits in native code.

Python raises ``KeyboardInterrupt`` only once the main thread is back in the interpreter, and a
``torch.distributed`` wait returns only at its timeout. :class:`StopWatchdog` sees the signal at once
(``signal.set_wakeup_fd``: the C-level handler writes to a pipe a daemon thread reads); when the main thread
has not stopped ``grace_s`` after it, the thread dumps every stack to stderr and ends the process with
``os._exit`` (the server writes no files: nothing is left half-written).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading

GRACE_S = 5.0


class StopWatchdog:
    """``with StopWatchdog(name):`` around a serving loop run on the main thread; outside the main thread
    (where Python delivers no signals) it does nothing."""

    def __init__(self, name: str, grace_s: float = GRACE_S):
        self.name = name
        self.grace_s = grace_s
        self.stopped = threading.Event()
        self._pipe: tuple[int, int] | None = None
        self._previous_fd = -1

    def __enter__(self) -> StopWatchdog:
        if threading.current_thread() is not threading.main_thread():
            return self
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # the C-level handler must never block on a full pipe
        self._pipe = (read_fd, write_fd)
        self._previous_fd = signal.set_wakeup_fd(write_fd)
        threading.Thread(
            target=self._watch, args=(read_fd,), name=f"{self.name} stop watchdog", daemon=True
        ).start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        if self._pipe is not None:
            signal.set_wakeup_fd(self._previous_fd)
            os.close(self._pipe[1])  # the watching thread reads end of file and returns

    def _watch(self, read_fd: int) -> None:
        try:
            while True:
                numbers = os.read(read_fd, 64)
                if not numbers or self.stopped.is_set():
                    return
                if signal.SIGINT in numbers and not self.stopped.wait(self.grace_s):
                    self._force()
        finally:
            os.close(read_fd)

    def _force(self) -> None:
        sys.stderr.write(
            f"{self.name}: still stopping {self.grace_s:g} s after Ctrl-C (a wait in native code "
            f"holds the interrupt); where each thread was:\n"
        )
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stdout.write(
            f"{self.name}: stopped (forced: a native wait did not return within {self.grace_s:g} s)\n"
        )
        sys.stdout.flush()
        os._exit(0)  # the stop the user asked for, as the ordinary way exits
