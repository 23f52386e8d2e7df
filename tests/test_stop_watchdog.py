"""``StopWatchdog``: Ctrl-C ends a serving process even while its main thread waits in native code that
holds the interrupt (a ``torch.distributed`` store wait returns only at its timeout), and an ordinary
interrupt still ends it the ordinary way. Each case is a child process that prints ``waiting`` and is
then sent SIGINT; what it printed says which way it ended (no clock is asserted on). The child handles
SIGINT as a process started from a terminal does, even when pytest was started in the background by a
non-interactive shell (which ignores SIGINT in everything it starts)."""

import signal
import subprocess
import sys
import threading
from pathlib import Path

from saguaro.cli.stop_watchdog import StopWatchdog

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import datetime, dis, signal, sys, threading, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal, however pytest was started
import torch.distributed as dist
from saguaro.cli.stop_watchdog import StopWatchdog

native = sys.argv[1] == "native"
store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=120)) if native else None


def wait_forever():
    if native:
        store.wait(["never set"])  # native: the interrupt waits for this to return
        print("the native wait returned", flush=True)
    else:
        time.sleep(120)


def announce_once_inside_the_wait():
    # Says "waiting" only when the main thread is inside the wait's call with the GIL let go (this thread
    # holds it), past the last place the interpreter checks for signals: an interrupt sent earlier would
    # be raised before the wait began, and the test would not test the wait.
    main = threading.main_thread().ident
    while True:
        frame = sys._current_frames().get(main)
        if frame is not None and frame.f_code is wait_forever.__code__:
            at = next(i for i in dis.get_instructions(frame.f_code) if i.offset == frame.f_lasti)
            if at.opname.startswith("CALL"):
                print("waiting", flush=True)
                return
        time.sleep(0.005)


try:
    with StopWatchdog("child", grace_s=1.0):
        threading.Thread(target=announce_once_inside_the_wait, daemon=True).start()
        wait_forever()
except KeyboardInterrupt:
    print("child: stopped", flush=True)
"""


def interrupted(how: str) -> tuple[int, str, str]:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, how],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "waiting"
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=90)  # the store's own timeout, 120 s, is longer
    return child.returncode, out, err


def test_a_native_wait_is_ended_with_every_threads_stack():
    code, out, err = interrupted("native")
    assert "child: stopped (forced: a native wait did not return within 1 s)" in out, (out, err)
    assert "the native wait returned" not in out and code == 0
    assert "still stopping 1 s after Ctrl-C" in err and "in wait_forever" in err, err


def test_an_interruptible_wait_stops_the_ordinary_way():
    code, out, err = interrupted("python")
    assert out.strip() == "child: stopped" and code == 0, (out, err)
    assert "still stopping" not in err, err


def test_outside_the_main_thread_it_does_nothing_and_inside_it_restores_the_wakeup_fd():
    seen = []

    def body():
        with StopWatchdog("x") as dog:
            seen.append(dog._pipe)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [None]
    before = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(before)
    with StopWatchdog("x") as dog:
        assert signal.set_wakeup_fd(dog._pipe[1]) == dog._pipe[1]  # ours while inside
    assert signal.set_wakeup_fd(before) == before
