"""The draft server's loop (``saguaro draft-server``): one target at a time, whatever arrives at its port.

One thread, one ``select``. A bad connection is closed and logged, the server goes on; a probe is
answered any time, a second target told it is busy. A served session ends on a message that breaks
the layout, limits or sequence, end of file or a failed keepalive."""

from __future__ import annotations

import logging
import select
import socket
import threading
from collections.abc import Callable

import torch

from saguaro.core.config import SaguaroConfig
from saguaro.core.errors import ConfigError
from saguaro.runtime.base.wire import Channel, WireError
from saguaro.runtime.draft.server import SpeculationServer
from saguaro.runtime.lanes import remote_handshake as hs
from saguaro.runtime.lanes.protocol import Method
from saguaro.runtime.lanes.remote import OPTIONS
from saguaro.runtime.lanes.remote_messages import (
    BYE,
    CALL,
    ERROR,
    METHODS,
    POST,
    REPLY,
    REQUESTS,
    Bounds,
    decode_args,
    encode_result,
    encode_text,
)

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 10.0
PAIR_TIMEOUT_S = 60.0  # a message announced by its doorbell must arrive within this
POLL_S = 0.5  # how often the loop looks at its stop event
# keepalive: a silent peer (network gone) is dropped TCP_KEEPIDLE + TCP_KEEPINTVL × TCP_KEEPCNT seconds on
KEEPALIVE = {"TCP_KEEPIDLE": 10, "TCP_KEEPINTVL": 5, "TCP_KEEPCNT": 3}


def check_listen(host: str, secret: bytes | None) -> None:
    """``ConfigError`` for a server reachable from other hosts without a secret."""
    if secret is None and not hs.is_loopback(host):
        raise ConfigError(
            f"refusing to listen on {host} without a secret: anyone who can reach that address could connect and "
            "use the draft; give --secret-file PATH (or set SAGUARO_DRAFT_SECRET) on both sides, or listen on "
            "127.0.0.1"
        )


class Session:
    """A served target: its socket, pair, channel and speculation server."""

    def __init__(self, sock, group, store, channel: Channel, server: SpeculationServer, bounds: Bounds, peer):
        self.sock, self.group, self.store, self.channel = sock, group, store, channel
        self.server, self.bounds, self.peer = server, bounds, peer
        self.seq, self.failure = 0, None


class DraftServer:
    """Listens on ``host:port`` and serves ``make_server(config)`` to one target at a time; ``draft`` is the
    description sent to every client."""

    def __init__(
        self,
        host: str,
        port: int,
        secret: bytes | None,
        make_server: Callable[[SaguaroConfig], object],
        draft: dict,
        device: torch.device,
    ):
        check_listen(host, secret)
        self.secret, self.make_server, self.draft, self.device = secret, make_server, dict(draft), device
        self.listener = hs.listening_socket(host, port)
        self.session: Session | None = None

    @property
    def address(self) -> str:
        host, port = self.listener.getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def serve(self, stop: threading.Event | None = None) -> None:
        """Serve until ``stop`` is set or an interrupt arrives; everything is closed on the way out."""
        try:
            with torch.inference_mode():
                while stop is None or not stop.is_set():
                    watched = [self.listener] + ([self.session.sock] if self.session is not None else [])
                    readable = select.select(watched, [], [], POLL_S)[0]
                    if self.session is not None and self.session.sock in readable:
                        self._serve_one()
                    if self.listener in readable:
                        self._accept()
        finally:
            self.close()

    def close(self) -> None:
        self._end_session("the server stops")
        self.listener.close()

    def _accept(self) -> None:
        conn, peer = self.listener.accept()
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hs.server_auth(conn, self.secret)
            if not self._answer(conn, hs.recv_json(conn, hs.CONFIG), peer):
                conn.close()
        except Exception as exc:
            log.warning("draft server: closed the connection from %s: %s: %s", peer, type(exc).__name__, exc)
            conn.close()

    def _answer(self, conn, hello: dict, peer) -> bool:
        """Reply to a client's config; True when the connection becomes the served session."""
        config = hello.get("config")
        if (
            set(hello) != {"probe", "config", "device_type"}
            or not isinstance(config, dict)
            or set(config) != set(OPTIONS)
            or hello["device_type"] not in ("cpu", "cuda")
        ):
            raise hs.HandshakeError(f"a config document of the wrong form (keys {sorted(hello)})")
        try:
            config = SaguaroConfig(**config, mode="ssd")
        except (ConfigError, TypeError) as exc:
            hs.send_json(conn, hs.INFO, {"ok": False, "error": f"bad options: {exc}"})
            return False
        bound = 2 * self.draft["max_positions"] + (config.k + 1) * (config.budget + 2) + 1024
        draft = dict(self.draft, k=config.k, max_capacity=bound)
        if hello["probe"] is True:
            hs.send_json(conn, hs.INFO, {"ok": True, "draft": draft})
            return False
        if self.session is not None and self._gone(self.session.sock):
            self._end_session("end of file")  # its target closed it, and this one came first
        if self.session is not None:
            hs.send_json(
                conn, hs.INFO, {"ok": False, "error": f"busy: serving the target at {self.session.peer}"}
            )
            return False
        try:
            server = self.make_server(config)
            server.draft.recorder = None  # a session that died tracing left its recorder on the runner
        except Exception as exc:
            hs.send_json(conn, hs.INFO, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            return False
        local_ip = conn.getsockname()[0]
        backend = hs.pair_backend(self.device.type, hello["device_type"])
        store, port, prefix = hs.open_store(local_ip, HANDSHAKE_TIMEOUT_S)
        hs.send_json(conn, hs.INFO, {"ok": True, "draft": draft, "store_port": port, "prefix": prefix})
        device = self.device if backend == "nccl" else torch.device("cpu")
        group = hs.open_pair(store, prefix, 0, local_ip, backend, device, PAIR_TIMEOUT_S)
        hs.answer_pings(conn)
        conn.settimeout(None)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in KEEPALIVE.items():
            if hasattr(socket, option):
                conn.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
        channel = Channel(group, 1, device, timeout_s=PAIR_TIMEOUT_S)
        self.session = Session(
            conn, group, store, channel, server, Bounds(self.draft["vocab_size"], config.k, bound), peer
        )
        log.info("draft server: serving the target at %s (%s)", peer, backend)
        return True

    @staticmethod
    def _gone(sock) -> bool:
        """Whether the peer closed ``sock`` (end of file pending, no doorbell before it)."""
        if not select.select([sock], [], [], 0)[0]:
            return False
        try:
            return sock.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _end_session(self, why: str) -> None:
        session, self.session = self.session, None
        if session is not None:
            log.info("draft server: the target at %s is gone (%s); waiting for the next", session.peer, why)
            session.sock.close()

    def _serve_one(self) -> None:
        """One message of the served target (its doorbell byte has arrived)."""
        session = self.session
        try:
            if not session.sock.recv(1):
                return self._end_session("end of file")
            message = session.channel.recv(REQUESTS, seq=session.seq + 1)
            session.seq = message.seq
            if message.code == BYE:
                return self._end_session("it said goodbye")
            reply = message.code >= CALL
            method = METHODS[message.code - (CALL if reply else POST)]
            args = decode_args(method, message.tensors, session.bounds)
        except (WireError, OSError) as exc:
            log.warning("draft server: dropping the target at %s: %s", session.peer, exc)
            return self._end_session(str(exc))
        try:
            if session.failure is not None and method not in (Method.OPEN, Method.WARM_UP):
                raise session.failure
            session.failure = None
            result = method.bound_to(session.server)(*args)
            code, tensors = REPLY + METHODS.index(method), encode_result(method, result) if reply else None
        except Exception as exc:
            session.failure = exc
            code, tensors = ERROR, [encode_text(f"{type(exc).__name__}: {exc}")]
        if reply:
            try:
                sent = session.channel.send(code, message.seq, tensors)
                session.sock.sendall(b"\x01")
                sent.wait()
            except (WireError, OSError) as exc:
                self._end_session(f"the reply could not be sent: {exc}")
