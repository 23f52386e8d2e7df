"""A second process that compiles queued stages beside the compile thread, to fill Inductor's caches.

One compile thread keeps one core busy (dynamo, AOT autograd, codegen and g++ under one lock); the helper
(``python -m saguaro.lower.compile_helper_main``) compiles the next queued stage meanwhile, and the thread's
own compile of it then reads Inductor's caches. Nothing the helper makes runs here: a helper that fails,
dies or misses costs time, never tokens. Messages are ``torch.save`` payloads behind an 8-byte length on its
stdin / stdout; a request carries what :meth:`~saguaro.lower.lowering.CompiledStage.helper_request` packs.
``SAGUARO_COMPILE_HELPER=0`` turns it off. Measured: docs/measurements/2026-11-30-ssd-vs-sd-and-the-demo.md.
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
    """The helper process of one :class:`~saguaro.lower.compile_thread.BackgroundCompiler`, started on its
    first request; ``on_reply(job, ok, detail)`` comes from a reader thread per job (all fail if it dies)."""

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
        self._proc = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env
        )
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
            except Exception as exc:
                self._fail(f"could not send the request: {type(exc).__name__}: {exc}")
                return

    def _read_loop(self) -> None:
        proc = self._proc
        while True:
            try:
                reply = read_message(proc.stdout)
            except Exception as exc:
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
        (log.debug if stopping else log.info)(
            "compile helper stopped (%s); the compile thread compiles alone", why
        )
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


# What a stage's own compile and the helper's must do alike for Inductor's caches to serve one from the other
def inductor_settings(patch: dict | None):
    """A context with Inductor's config patched by ``patch`` (nothing to do when it is empty or None)."""
    if not patch:
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config

    return inductor_config.patch(patch)


def mark_dynamic(args, dynamic_dims: dict) -> None:
    """Mark ``dynamic_dims`` (``{position: dims}``) of the tensors among ``args`` dynamic for dynamo."""
    for position, dims in dynamic_dims.items():
        if position < len(args) and isinstance(args[position], torch.Tensor):
            for dim in dims:
                torch._dynamo.maybe_mark_dynamic(args[position], dim)
