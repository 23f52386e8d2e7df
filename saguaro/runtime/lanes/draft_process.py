"""The draft process of a process lane: its only entry point (``python -P -c <boot> ROOT
saguaro.runtime.lanes.draft_process FD PARENT_PID``, never the caller's script). It ignores SIGINT,
exits when its parent dies, builds its server from the ``init`` message, answers with its pid and
serves until ``close`` or end of file."""

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
    """Exit as soon as the parent is gone (``getppid`` changes), even mid-computation."""

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
    import importlib

    import torch

    from saguaro.runtime.lanes.process import send, serve

    torch.set_num_threads(1)
    sys.path.extend(p for p in parent_path if p not in sys.path)  # where the model's class may live
    try:
        # the function that builds the server: a captured draft's, or a loaded artifact's
        module, name = description.get("server", "saguaro.compile:draft_server").split(":")
        server = getattr(importlib.import_module(module), name)(description, config)
    except Exception as exc:
        send(conn, (seq, False, f"{type(exc).__name__}: {exc}", None))
        return 1
    send(conn, (seq, True, os.getpid(), None))
    serve(conn, server)
    sys.stdout.flush()
    sys.stderr.flush()
    # skip the interpreter's teardown, slow with torch loaded (see
    # docs/measurements/2026-12-07-figures-from-runtime-base-draft-lanes.md): nothing is left to save
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
