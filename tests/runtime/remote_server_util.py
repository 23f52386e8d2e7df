"""A ``saguaro draft-server`` child process for the remote-lane tests: started, awaited on its ready line
(no sleeps), killed or stopped with Ctrl-C, restarted on the same address."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Ctrl-C as a terminal delivers it, however pytest was started: a process started in the background by a
# non-interactive shell ignores SIGINT, and its children inherit that (a Ctrl-C test would then wait forever)
BOOT = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from saguaro.cli.main import main; sys.exit(main(sys.argv[1:]))"
)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_command(address: str, draft_dir, secret_file) -> list:
    return [
        sys.executable,
        "-c",
        BOOT,
        "draft-server",
        "--listen",
        address,
        "--draft",
        str(draft_dir),
        "--secret-file",
        str(secret_file),
        "--threads",
        "1",
    ]


class ServerProcess:
    """The draft server at ``address`` serving the draft saved in ``draft_dir``."""

    def __init__(self, address: str, draft_dir, secret_file):
        self.address, self.draft_dir, self.secret_file = address, draft_dir, secret_file
        self.process: subprocess.Popen | None = None
        self.lines: list[str] = []
        self.stderr_path = Path(secret_file).parent / "server.stderr"  # the stacks a forced stop writes

    def start(self) -> ServerProcess:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        env.pop("SAGUARO_DRAFT_SECRET", None)
        with open(self.stderr_path, "a") as stderr:
            self.process = subprocess.Popen(
                server_command(self.address, self.draft_dir, self.secret_file),
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                stderr=stderr,
                text=True,
            )
        self.lines = [self.process.stdout.readline().strip(), self.process.stdout.readline().strip()]
        assert self.lines[1] == "ready", (
            f"the draft server did not start: {self.lines} {self.stderr()[-3000:]}"
        )
        return self

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def stderr(self) -> str:
        return self.stderr_path.read_text() if self.stderr_path.exists() else ""

    def interrupt(self, timeout_s: float = 30) -> tuple[int, str]:
        """Ctrl-C: the exit status and what it printed after the ready line (a stop held up by a native
        wait is forced 5 s after the signal, ``stop_watchdog``)."""
        self.process.send_signal(signal.SIGINT)
        rest, _ = self.process.communicate(timeout=timeout_s)
        return self.process.returncode, rest

    def stop(self) -> None:
        if self.alive():
            self.process.kill()
        if self.process is not None:
            self.process.wait()
            self.process.stdout.close()
