"""The draft process of a process lane (``saguaro.runtime.lanes.process``): its only entry point.

Started as ``python -P -c <boot> ROOT saguaro.runtime.lanes.draft_process FD PARENT_PID``, so the caller's script is
never imported here. It ignores SIGINT, exits when its parent dies, reads the ``init`` message (the
draft's description, the config, the caller's ``sys.path`` for the model's module), rebuilds the
draft from the files the caller wrote, builds its :class:`SpeculationServer`, answers with its pid,
and serves until ``close`` or end-of-file.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

PARENT_POLL_S = 0.5


def watch_parent(parent_pid: int) -> None:
    """Exit as soon as the parent is gone (re-parented: ``getppid`` changes), even mid-computation."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="saguaro-parent-watch", daemon=True).start()


def main(argv: list) -> int:
    fd, parent_pid = int(argv[0]), int(argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch_parent(parent_pid)
    conn = Connection(fd)
    try:
        seq, _, (description, config, parent_path), _ = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return 0  # the caller gave up before start-up finished
    import torch

    import importlib

    from saguaro.runtime.lanes.process import send, serve

    torch.set_num_threads(1)
    sys.path.extend(p for p in parent_path if p not in sys.path)  # the model class's module, if the caller's
    try:
        # the description names the function that builds the server: a captured draft, or a loaded artifact's
        module, name = description.get("server", "saguaro.compile:draft_server").split(":")
        server = getattr(importlib.import_module(module), name)(description, config)
    except Exception as exc:  # noqa: BLE001 - reported to the caller, which then uses the thread lane
        send(conn, (seq, False, f"{type(exc).__name__}: {exc}", None))
        return 1
    send(conn, (seq, True, os.getpid(), None))
    serve(conn, server)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's teardown (a second or more with torch loaded): nothing is left to save


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
