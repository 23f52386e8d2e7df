"""Connecting a target to a draft server: the listening port, the secret, the pair of ranks.

Fixed frames (magic, kind, length ≤ :data:`MAX_FRAME`, every read under a timeout), in order:
``HELLO`` / ``CHALLENGE`` / ``PROOF`` (HMAC of both nonces each way; ``REFUSED`` before any model data),
``CONFIG`` / ``INFO`` (one JSON document each way), then the ``TCPStore``, the two-rank group and
``PING`` s for the clock offset (docs/design.md, "The remote lane"). Failures: :class:`HandshakeError`."""

from __future__ import annotations

import datetime
import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import socket
import struct
import time

import torch

from saguaro.core.errors import ConfigError, SaguaroError

MAGIC = b"SGRH"
HEADER = struct.Struct(">4sBI")  # magic, kind, payload length
MAX_FRAME = 1 << 16
HELLO, CHALLENGE, PROOF, REFUSED, CONFIG, INFO, PING, PONG, READY = range(1, 10)
NONCE = 32
PINGS = 8
SECRET_ENV = "SAGUARO_DRAFT_SECRET"


class HandshakeError(SaguaroError):
    """The peer broke the handshake: a bad frame, a wrong secret, a timeout, a closed socket."""


def parse_address(address: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``"HOST:PORT"`` (``"[v6]:PORT"``; ``":PORT"`` or ``"PORT"`` for loopback) as ``(host, port)``;
    ``ConfigError`` otherwise."""
    text = str(address).strip()
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "", text
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"draft address {address!r} is not allowed: give HOST:PORT with a port in 1..65535")
    return host or default_host, int(port)


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback one."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise ConfigError(f"cannot resolve the host {host!r}: {exc}") from exc
    return all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def read_secret(path: str | None) -> bytes | None:
    """The shared secret: the file at ``path`` stripped (``ConfigError`` if unreadable or empty), else
    :data:`SECRET_ENV`, else None."""
    if path is not None:
        try:
            with open(path, "rb") as f:
                secret = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the secret file {path!r}: {exc}") from exc
        if not secret:
            raise ConfigError(f"the secret file {path!r} is empty")
        return secret
    value = os.environ.get(SECRET_ENV, "").strip()
    return value.encode() if value else None


def mac(secret: bytes | None, role: bytes, *nonces: bytes) -> bytes:
    return hmac.new(secret or b"", role + b"".join(nonces), hashlib.sha256).digest()


def send_frame(sock: socket.socket, kind: int, payload: bytes = b"") -> None:
    sock.sendall(HEADER.pack(MAGIC, kind, len(payload)) + payload)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        try:
            chunk = sock.recv(n - len(data))
        except (TimeoutError, OSError) as exc:
            raise HandshakeError(f"the peer did not answer ({type(exc).__name__}: {exc})") from exc
        if not chunk:
            raise HandshakeError("the peer closed the connection")
        data += chunk
    return bytes(data)


def recv_frame(sock: socket.socket, kinds: tuple, max_len: int = MAX_FRAME) -> tuple[int, bytes]:
    magic, kind, length = HEADER.unpack(recv_exact(sock, HEADER.size))
    if magic != MAGIC or kind not in kinds or length > max_len:
        raise HandshakeError(f"not a frame expected here (kind {kind}, {length} bytes)")
    return kind, recv_exact(sock, length)


def send_json(sock: socket.socket, kind: int, doc: dict) -> None:
    send_frame(sock, kind, json.dumps(doc).encode())


def recv_json(sock: socket.socket, kind: int) -> dict:
    _, payload = recv_frame(sock, (kind,))
    try:
        doc = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise HandshakeError(f"not a JSON document: {exc}") from exc
    if not isinstance(doc, dict):
        raise HandshakeError("the JSON document is not an object")
    return doc


def client_auth(sock: socket.socket, secret: bytes | None) -> None:
    """Prove the secret to the server and check that it knows it too; ``HandshakeError`` otherwise."""
    nonce = secrets.token_bytes(NONCE)
    send_frame(sock, HELLO, nonce)
    kind, payload = recv_frame(sock, (CHALLENGE, REFUSED))
    if kind == REFUSED or len(payload) != 2 * NONCE:
        raise HandshakeError(f"the server refused the connection: {payload[:200].decode(errors='replace')}")
    theirs, proof = payload[:NONCE], payload[NONCE:]
    if not hmac.compare_digest(proof, mac(secret, b"server", nonce, theirs)):
        raise HandshakeError(
            "the server does not know our secret (wrong --secret-file or SAGUARO_DRAFT_SECRET on one side)"
        )
    send_frame(sock, PROOF, mac(secret, b"client", theirs, nonce))
    kind, payload = recv_frame(sock, (READY, REFUSED))
    if kind == REFUSED:
        raise HandshakeError(f"the server refused the connection: {payload[:200].decode(errors='replace')}")


def server_auth(sock: socket.socket, secret: bytes | None) -> None:
    """Check the client's proof of the secret; ``HandshakeError`` (the client told) when it has none."""
    _, theirs = recv_frame(sock, (HELLO,), NONCE)
    if len(theirs) != NONCE:
        raise HandshakeError("a HELLO without a nonce")
    nonce = secrets.token_bytes(NONCE)
    send_frame(sock, CHALLENGE, nonce + mac(secret, b"server", theirs, nonce))
    _, proof = recv_frame(sock, (PROOF,), NONCE)
    if not hmac.compare_digest(proof, mac(secret, b"client", nonce, theirs)):
        send_frame(sock, REFUSED, b"the client could not prove the shared secret")
        raise HandshakeError("the client could not prove the shared secret")
    send_frame(sock, READY)


def pair_backend(server_device_type: str, client_device_type: str) -> str:
    """NCCL when both sides run on CUDA (written, never run here), else gloo with CPU tensors."""
    return "nccl" if server_device_type == client_device_type == "cuda" else "gloo"


def listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(16)
    return sock


def open_store(local_ip: str, timeout_s: float) -> tuple:
    """The rendezvous store (master) on ``local_ip`` at an ephemeral port: ``(store, port, prefix)``."""
    listener = listening_socket(local_ip, 0)
    port = listener.getsockname()[1]
    store = torch.distributed.TCPStore(
        local_ip,
        port,
        2,
        True,
        datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
    )
    return store, port, secrets.token_hex(16)


def open_pair(
    store, prefix: str, rank: int, local_ip: str, backend: str, device: torch.device, timeout_s: float
):
    """The two-rank process group of one connection (rank 0 the server, 1 the client)."""
    dist = torch.distributed
    scoped = dist.PrefixStore(f"saguaro/{prefix}/", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":  # pragma: no cover - needs CUDA on both hosts
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        torch.cuda.set_device(device)
        return dist.ProcessGroupNCCL(scoped, rank, 2, options)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_ip)]
    options._timeout = timeout
    return dist.ProcessGroupGloo(scoped, rank, 2, options)


def measure_offset(sock: socket.socket) -> tuple[int, int]:
    """``(offset_ns, rtt_ns)``: the server's ``time.monotonic_ns()`` minus ours at the middle of the
    shortest of :data:`PINGS` round trips."""
    best = None
    for _ in range(PINGS):
        sent = time.monotonic_ns()
        send_frame(sock, PING)
        _, payload = recv_frame(sock, (PONG,), 8)
        back = time.monotonic_ns()
        if len(payload) != 8:
            raise HandshakeError("a PONG without a clock reading")
        theirs = struct.unpack(">q", payload)[0]
        if best is None or back - sent < best[1]:
            best = (theirs - (sent + back) // 2, back - sent)
    send_frame(sock, READY)
    return best


def answer_pings(sock: socket.socket) -> None:
    while recv_frame(sock, (PING, READY), 0)[0] == PING:
        send_frame(sock, PONG, struct.pack(">q", time.monotonic_ns()))
