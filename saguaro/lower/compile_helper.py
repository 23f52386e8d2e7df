"""A second process that compiles stages beside the compile thread, to fill Inductor's on-disk caches
(``compile="background"`` on a CPU with two cores or more).

Compiling a stage is CPU-bound Python (dynamo, AOT autograd, Inductor's code generation) and one g++
run, all under one process lock: one compile thread keeps one core busy, whatever the machine has.
The helper takes the next queued stage while the thread compiles another; when it is done, the thread
compiles that stage again, which now reads what the helper wrote to Inductor's caches (AOT autograd's
and the FX graph cache: measured on the default pair, 1.2-1.6 s a stage instead of 8-16 s). Nothing
the helper makes is run in this process: the stage's own compile still makes it, so a helper that fails,
dies or misses the cache costs time, never tokens.

The helper runs ``python -m saguaro.lower.compile_helper_main``; requests and replies are ``torch.save``
payloads behind an 8-byte length on its stdin and stdout. A request: the stage graph
(:func:`~saguaro.lower.graph_transport.pack_graph`), the scratch arguments of the compile job, the
calling thread's modes, the dimensions marked dynamic, the Inductor options and config patch, all as
the compile thread uses them. Set ``SAGUARO_COMPILE_HELPER=0`` to compile on the thread alone.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import struct
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HELPER_ENV = "SAGUARO_COMPILE_HELPER"
_LENGTH = struct.Struct(">Q")


def helper_wanted() -> bool:
    """A helper pays where a second core is there to run it, and is not switched off."""
    return os.environ.get(HELPER_ENV, "1") != "0" and (os.cpu_count() or 1) >= 2


def write_message(stream, obj) -> None:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    stream.write(_LENGTH.pack(len(data)))
    stream.write(data)
    stream.flush()


def read_message(stream):
    """The next message, or None at the end of the stream."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (size,) = _LENGTH.unpack(head)
    data = stream.read(size)
    if len(data) < size:
        return None
    return torch.load(io.BytesIO(data), weights_only=False)


class CompileHelper:
    """The helper process of one :class:`~saguaro.lower.compile_thread.BackgroundCompiler`, started on
    its first request. ``on_reply(job, ok, detail)`` is called from a reader thread when the helper has
    compiled ``job`` (``ok``), failed to (``detail`` says why), or died (every job sent fails). One
    request at a time: :attr:`busy` while one is out."""

    def __init__(self, on_reply):
        self._on_reply = on_reply
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._outbox: deque = deque()  # jobs to send, in order
        self._sent: deque = deque()  # jobs sent, awaiting their replies (replies come in order)
        self._wake = threading.Condition(self._lock)
        self.dead = False
        self.busy = False
        self._stopping = False  # stop() was called: the end is no news

    def start(self) -> None:
        """Start the helper now rather than with the first request (it warms Inductor up meanwhile)."""
        with self._lock:
            if self._proc is None and not self.dead:
                self._start()

    def send(self, job) -> None:
        """Queue ``job`` (its ``helper_request()`` is built on the sender thread)."""
        with self._lock:
            if self.dead:
                raise RuntimeError("the compile helper is not running")
            self.busy = True
            self._outbox.append(job)
            if self._proc is None:
                self._start()
            self._wake.notify_all()

    def _start(self) -> None:
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])  # where ``import saguaro`` finds this copy
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (package_root, env.get("PYTHONPATH"))))
        command = [sys.executable, "-m", "saguaro.lower.compile_helper_main"]
        self._proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, env=env)
        log.info("compile helper started (pid %d)", self._proc.pid)
        threading.Thread(target=self._send_loop, name="saguaro-compile-helper-send", daemon=True).start()
        threading.Thread(target=self._read_loop, name="saguaro-compile-helper-read", daemon=True).start()

    def _send_loop(self) -> None:
        while True:
            with self._lock:
                while not self._outbox and not self.dead:
                    self._wake.wait()
                if self.dead:
                    return
                job = self._outbox.popleft()
                self._sent.append(job)
                proc = self._proc
            try:
                write_message(proc.stdin, job.helper_request())
            except Exception as exc:  # noqa: BLE001 - a request that cannot be sent fails its job
                self._fail(f"could not send the request: {type(exc).__name__}: {exc}")
                return

    def _read_loop(self) -> None:
        proc = self._proc
        while True:
            try:
                reply = read_message(proc.stdout)
            except Exception as exc:  # noqa: BLE001
                reply, why = None, f"{type(exc).__name__}: {exc}"
            else:
                why = f"exited with code {proc.poll()}"
            if reply is None:
                self._fail(why)
                return
            with self._lock:
                job = self._sent.popleft()
                self.busy = bool(self._outbox or self._sent)
            self._on_reply(job, reply["ok"], reply.get("detail", ""))

    def _fail(self, why: str) -> None:
        """The helper is gone: every job sent or waiting fails, and no more are taken."""
        with self._lock:
            if self.dead:
                return
            self.dead, self.busy = True, False
            stopping = self._stopping
            jobs = list(self._sent) + list(self._outbox)
            self._sent.clear()
            self._outbox.clear()
            self._wake.notify_all()
        (log.debug if stopping else log.info)("compile helper stopped (%s); the compile thread compiles alone", why)
        for job in jobs:
            self._on_reply(job, False, f"the helper stopped: {why}")

    def stop(self) -> None:
        """End the helper process (a compile under way there is killed) and fail what it held."""
        with self._lock:
            proc, self._stopping = self._proc, True
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self._fail("stopped")


# What a stage's own compile (CompiledStage) and the helper's (compile_helper_main) must do alike, so that
# Inductor's caches serve one from the other: the config patch around the compile, the dimensions marked dynamic
def inductor_settings(patch: dict | None):
    """A context with Inductor's config patched by ``patch`` (nothing to do when it is empty or None)."""
    if not patch:
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config

    return inductor_config.patch(patch)


def mark_dynamic(args, dynamic_dims: dict) -> None:
    """Mark ``dynamic_dims`` of the tensors among ``args`` dynamic for dynamo's next compile (a mark on a
    size of 1, or on a size the graph fixes, is dropped: dynamo specialises it)."""
    for position, dims in dynamic_dims.items():
        if position < len(args) and isinstance(args[position], torch.Tensor):
            for dim in dims:
                torch._dynamo.maybe_mark_dynamic(args[position], dim)
