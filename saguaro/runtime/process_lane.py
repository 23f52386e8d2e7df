"""The process lane: the draft server in another process, reached through ``torch.distributed``.

Transport is a gloo process group of two ranks (0: the caller, 1: the draft process) built on a
``TCPStore`` over loopback, without touching the default process group. A message is a call of a
:class:`~saguaro.runtime.draft_server.SpeculationServer` method by name: ``(method, args, reply?)``
pickled (tensors included) into one ``uint8`` tensor after a ``[2]`` header of its length and
whether a reply is wanted. The draft process runs each call in order and, for calls, sends the
pickled result back, so a posted ``build`` overlaps the caller's verification.
"""

from __future__ import annotations

import datetime
import io
import logging
import pickle
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from saguaro.core.config import SaguaroConfig
from saguaro.runtime.lanes import DraftLaneError
from saguaro.runtime.trace import traced

log = logging.getLogger(__name__)

CLOSE = "close"  # the message that ends the draft process


def _send_message(pg, obj) -> None:
    buffer = io.BytesIO()
    pickle.dump(obj, buffer, protocol=pickle.HIGHEST_PROTOCOL)
    payload = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)  # [n]
    peer = 1 - pg.rank()
    pg.send([torch.tensor([payload.numel()], dtype=torch.long)], peer, 0).wait()
    pg.send([payload], peer, 0).wait()


def _recv_message(pg, timeout_s: float | None = None, recorder=None, track: str = "host"):
    """The next message; with a ``recorder``, a ``recv`` slice from its header's arrival (the wait
    before it is not transport) to the unpickled object."""
    peer = 1 - pg.rank()
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    size = torch.empty(1, dtype=torch.long)
    work = pg.recv([size], peer, 0)
    work.wait() if timeout is None else work.wait(timeout)
    with traced(recorder, track, "recv"):
        payload = torch.empty(int(size[0]), dtype=torch.uint8)
        work = pg.recv([payload], peer, 0)
        work.wait() if timeout is None else work.wait(timeout)
        return pickle.loads(payload.numpy().tobytes())


def serve(port: int, remote_draft, config: SaguaroConfig, timeout_s: float) -> None:
    """The draft process: build the draft server, then run the calls it receives until ``close``."""
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=timeout_s))
    store.set("draft_up", "1")  # before the group: the caller waits for this, checking we are alive
    pg = dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(days=1))  # idle between generations
    server = remote_draft(config)
    with torch.inference_mode():
        while True:
            method, args, reply = _recv_message(pg, recorder=server.draft.recorder, track="draft")
            if method == CLOSE:
                return
            result = getattr(server, method)(*args)
            if reply:
                with traced(server.draft.recorder, "draft", f"send {method}"):
                    _send_message(pg, result)


class ProcessLane:
    """The draft server in a spawned process; started once per Program and reused."""

    kind = "process"
    recorder = None  # a runtime.trace.TraceRecorder while a traced generate runs: transport slices

    def __init__(self, remote_draft, config: SaguaroConfig, timeout_s: float):
        """``remote_draft(config)`` (picklable) builds the :class:`SpeculationServer` in the child."""
        self.timeout_s = timeout_s
        self.store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        started = time.perf_counter()
        self.process = mp.get_context("spawn").Process(
            target=serve, args=(self.store.port, remote_draft, config, timeout_s), daemon=True,
            name="saguaro-draft-lane")
        self.process.start()
        self._wait_for_child(started)
        self.pg = dist.ProcessGroupGloo(self.store, 0, 2, datetime.timedelta(seconds=timeout_s))
        log.info("draft process lane up in %.1fs (pid %d)", time.perf_counter() - started, self.process.pid)

    def _wait_for_child(self, started: float) -> None:
        """Wait for the draft process to reach the store, noticing at once if it dies on the way (for
        example a script without ``if __name__ == "__main__":``, which ``spawn`` needs)."""
        while not self.store.check(["draft_up"]):
            if not self.process.is_alive():
                raise DraftLaneError(
                    f"draft process exited during start-up (exit code {self.process.exitcode}); a script "
                    "that uses lane='process' needs `if __name__ == \"__main__\":`")
            if time.perf_counter() - started > self.timeout_s:
                self.process.kill()
                raise DraftLaneError(f"draft process did not start within {self.timeout_s:.0f}s")
            time.sleep(0.05)

    def _guard(self, fn, *args):
        if not self.process.is_alive():
            raise DraftLaneError(f"draft process {self.process.pid} is dead (exit code {self.process.exitcode})")
        try:
            return fn(*args)
        except DraftLaneError:
            raise
        except Exception as exc:
            alive = "alive" if self.process.is_alive() else f"dead, exit code {self.process.exitcode}"
            raise DraftLaneError(f"draft process lane failed ({alive}): {type(exc).__name__}: {exc}") from exc

    def post(self, method: str, *args) -> None:
        """Send ``server.method(*args)`` to the draft process; it runs there while the caller goes on."""
        with traced(self.recorder, "host", f"send {method}"):
            self._guard(_send_message, self.pg, (method, args, False))

    def call(self, method: str, *args, timeout_s: float | None = None):
        """Run ``server.method(*args)`` in the draft process (after what was posted) and return its result,
        waiting at most ``timeout_s`` (default: the lane's timeout)."""
        def run():
            with traced(self.recorder, "host", f"send {method}"):
                _send_message(self.pg, (method, args, True))
            return _recv_message(self.pg, self.timeout_s if timeout_s is None else timeout_s, self.recorder)
        return self._guard(run)

    def settle(self) -> None:
        """Nothing to wait for here: the draft process's unneeded build ends on its own."""

    def close(self) -> None:
        if self.process.is_alive():
            try:
                _send_message(self.pg, (CLOSE, (), False))
            except Exception:  # noqa: BLE001 - closing a broken lane
                pass
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
