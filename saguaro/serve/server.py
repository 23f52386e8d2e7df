"""Start the server: check the address and the key, bind only the given host, print the address and the
model's name once it takes requests; SIGTERM / Ctrl-C stop accepting, finish the requests in flight, then
exit (uvicorn's graceful shutdown, then the app's lifespan drains the scheduler)."""

from __future__ import annotations

import ipaddress
import logging
import signal
import socket
import sys
from pathlib import Path

import uvicorn

from saguaro.core.errors import ConfigError
from saguaro.serve.app import Service, build_app

log = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_api_key(path) -> str | None:
    if path is None:
        return None
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--api-key-file {str(path)!r} is not a file: give a file holding the API key")
    key = file.read_text().strip()
    if not key:
        raise ConfigError(f"--api-key-file {str(path)!r} is empty: write the API key in it")
    return key


def read_chat_template(path) -> str | None:
    """The text of ``--chat-template FILE`` (None: the tokenizer's own template)."""
    if path is None:
        return None
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--chat-template {str(path)!r} is not a file: give a Jinja chat template file")
    text = file.read_text()
    if not text.strip():
        raise ConfigError(f"--chat-template {str(path)!r} is empty: write the template in it")
    return text


def check_address(host: str, api_key: str | None) -> None:
    """A host other than loopback needs a key: without one, anyone who reaches it could use the models."""
    if not is_loopback(host) and api_key is None:
        raise ConfigError(
            f"--host {host!r} is not a loopback address: serving it needs --api-key-file (every "
            "request must then carry Authorization: Bearer KEY); or serve on 127.0.0.1"
        )


class ReadyServer(uvicorn.Server):
    """uvicorn's server that writes ``announce(host, port)`` once it listens (the port is the bound one)."""

    def __init__(self, config, announce=None):
        super().__init__(config)
        self.announce = announce
        self.port: int | None = None

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        if (
            sig == signal.SIGTERM
        ):  # uvicorn raises a caught signal again once drained: SIGTERM drained exits 0
            self._captured_signals.remove(sig)

    async def startup(self, sockets=None):
        await super().startup(sockets=sockets)
        if self.started and self.servers:
            self.port = self.servers[0].sockets[0].getsockname()[1]
            if self.announce is not None:
                self.announce(self.config.host, self.port)


def make_server(
    program,
    tokenizer,
    model: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_batch: int = 8,
    max_queue: int = 64,
    api_key: str | None = None,
    announce=None,
    log_level: str = "warning",
    default_max_tokens: int | None = None,
    auth_health: bool = False,
    k_choice: str = "measured",
):
    """``(ReadyServer, Service)``: a server not yet started (``server.run()`` serves until SIGTERM).
    ``default_max_tokens``: a request's ``max_tokens`` when it names none (None: the room its prompt leaves);
    ``auth_health``: ``/health`` and ``/metrics`` need the key too (else they are open); ``k_choice``: the batch
    sessions' (``BatchSession``)."""
    if tokenizer is None:
        raise ConfigError("saguaro serve needs a tokenizer (beside the target, or in the exported program)")
    check_address(host, api_key)
    service = Service(
        program, tokenizer, model, max_batch, max_queue, api_key, default_max_tokens, auth_health, k_choice
    )
    config = uvicorn.Config(
        build_app(service),
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=None,
    )
    return ReadyServer(config, announce), service


def bound_socket(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: one the system picks), for a server run in a thread."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def print_ready(model: str):
    def announce(host, port):
        sys.stdout.write(f"saguaro serve: {model} at http://{host}:{port}/v1 (Ctrl-C or SIGTERM to stop)\n")
        sys.stdout.flush()

    return announce
