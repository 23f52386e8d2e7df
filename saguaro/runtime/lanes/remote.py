"""The remote lane: the draft server of another host (``saguaro draft-server``) over ``torch.distributed``
(docs/design.md, "The remote lane"). A dead or silent server or a reply out of sequence raises
``DraftLaneError``, and the generation finishes exactly without the lane."""

from __future__ import annotations

import datetime
import logging
import select
import socket

import torch

from saguaro.core.config import SaguaroConfig
from saguaro.core.errors import ConfigError
from saguaro.runtime.base.trace import traced
from saguaro.runtime.base.wire import Channel, WireError
from saguaro.runtime.lanes import remote_handshake as hs
from saguaro.runtime.lanes.process import uninterrupted
from saguaro.runtime.lanes.protocol import DraftLaneError, Method
from saguaro.runtime.lanes.remote_messages import (
    CALL,
    ERROR,
    METHODS,
    POST,
    REPLY,
    Bounds,
    decode_result,
    decode_text,
    encode_args,
    sent_batch,
)

log = logging.getLogger(__name__)

POLL_S = 0.1  # reply waits poll this often, so an interrupt is noticed promptly
CONNECT_TIMEOUT_S = 10.0
OPTIONS = ("k", "fan_out", "fan_out_budget", "saguaro_c", "fallback", "backend", "attention", "cuda_graphs")


class RemoteEndpoint:
    """Where a remote lane reaches its draft, and what the target expects of it."""

    def __init__(self, config: SaguaroConfig, target_spec):
        self.address = config.draft_address
        self.host, self.port = hs.parse_address(config.draft_address)
        self.secret_file = config.draft_secret_file
        self.config = config
        self.vocab_size, self.device = target_spec.vocab_size, target_spec.device
        self.dtype = str(target_spec.dtype).removeprefix("torch.")
        self.info: dict | None = None  # the draft's description, from the server

    @property
    def width(self) -> int:
        return self.info["width"]

    @property
    def max_positions(self) -> int:
        return self.info["max_positions"]

    def hello(self, config: SaguaroConfig, probe: bool) -> dict:
        options = {name: getattr(config, name) for name in OPTIONS}
        return {"probe": probe, "config": options, "device_type": self.device.type}

    def connect(self, config: SaguaroConfig, probe: bool, timeout_s: float) -> tuple[socket.socket, dict]:
        """Connect, prove the secret and exchange ``config``: ``(socket, the server's INFO)``;
        ``DraftLaneError`` when it cannot, ``ConfigError`` on a mismatched draft."""
        secret = hs.read_secret(self.secret_file)
        try:
            sock = socket.create_connection((self.host, self.port), timeout=min(timeout_s, CONNECT_TIMEOUT_S))
        except OSError as exc:
            raise DraftLaneError(
                f"cannot reach the draft server at {self.address}: {exc} (start it with "
                f"`saguaro draft-server --listen {self.address}`)"
            ) from exc
        try:
            sock.settimeout(timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hs.client_auth(sock, secret)
            hs.send_json(sock, hs.CONFIG, self.hello(config, probe))
            info = hs.recv_json(sock, hs.INFO)
            if info.get("ok") is not True:
                raise DraftLaneError(f"the draft server at {self.address} cannot serve: {info.get('error')}")
            self.check(info.get("draft"), config.k)
            return sock, info
        except hs.HandshakeError as exc:
            sock.close()
            raise DraftLaneError(f"draft server at {self.address}: {exc}") from exc
        except BaseException:
            sock.close()
            raise

    def probe(self, timeout_s: float = 30.0) -> dict:
        """The draft's description, checked against the target and kept; ``ConfigError`` on a mismatch."""
        sock, info = self.connect(self.config, probe=True, timeout_s=timeout_s)
        sock.close()
        self.info = info["draft"]
        return self.info

    def check(self, draft: dict | None, k: int) -> None:
        """The described draft must match the target's vocabulary, dtype and ``k`` (``ConfigError``) and
        carry positive limits (``DraftLaneError``)."""
        if not isinstance(draft, dict):
            raise DraftLaneError(f"the draft server at {self.address} sent no draft description")
        for name, ours, what in (
            ("vocab_size", self.vocab_size, "vocabulary size"),
            ("dtype", self.dtype, "dtype"),
            ("k", k, "k"),
        ):
            if draft.get(name) != ours:
                raise ConfigError(
                    f"{what} mismatch: the target has {name}={ours!r}, the draft served at "
                    f"{self.address} has {name}={draft.get(name)!r}"
                )
        for name in ("width", "max_positions", "max_capacity", "pid"):
            if not isinstance(draft.get(name), int) or draft[name] < 1:
                raise DraftLaneError(
                    f"the draft server at {self.address} sent a bad {name}: {draft.get(name)!r}"
                )


class RemoteLane:
    """One connection to a draft server; started per Program (and again after a failure)."""

    kind = "remote"
    recorder = None  # a TraceRecorder while a traced generate runs: transport slices

    def __init__(
        self, endpoint: RemoteEndpoint, config: SaguaroConfig, start_timeout_s: float, timeout_s: float
    ):
        self.endpoint, self.timeout_s = endpoint, timeout_s
        self.address = endpoint.address
        self.sock, self.group, self.store = None, None, None
        self._seq, self._broken = 0, None
        try:
            self.sock, info = endpoint.connect(config, probe=False, timeout_s=start_timeout_s)
            draft = info["draft"]
            local_ip, server_ip = self.sock.getsockname()[0], self.sock.getpeername()[0]
            backend = hs.pair_backend(draft.get("device_type"), endpoint.device.type)
            device = endpoint.device if backend == "nccl" else torch.device("cpu")
            self.store = torch.distributed.TCPStore(
                server_ip, int(info["store_port"]), 2, False, datetime.timedelta(seconds=start_timeout_s)
            )
            self.group = hs.open_pair(
                self.store, str(info["prefix"]), 1, local_ip, backend, device, timeout_s
            )
            self.offset_ns, self.rtt_ns = hs.measure_offset(self.sock)
        except (hs.HandshakeError, OSError, RuntimeError, KeyError, ValueError) as exc:
            self.close()
            if isinstance(exc, ConfigError):
                raise DraftLaneError(str(exc)) from exc
            raise DraftLaneError(
                f"cannot connect to the draft server at {self.address}: {type(exc).__name__}: {exc}"
            ) from exc
        except BaseException:
            self.close()
            raise
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        self.pid = draft["pid"]
        self.channel = Channel(self.group, 0, device, timeout_s=timeout_s)
        self.bounds = Bounds(endpoint.vocab_size, config.k, draft["max_capacity"])
        log.info(
            "remote draft lane connected to %s (%s, clock offset %+d us, rtt %d us)",
            self.address,
            backend,
            self.offset_ns // 1000,
            self.rtt_ns // 1000,
        )

    def _send(self, method: Method, code: int, args: tuple) -> None:
        if self._broken is not None:
            raise DraftLaneError(
                f"the connection to the draft server at {self.address} is unusable: {self._broken}"
            )
        self._seq += 1
        tensors = encode_args(method, args)
        sent_batch(self.bounds, method, args)
        try:
            with traced(self.recorder, "host", f"send {method.value}"), uninterrupted():
                sent = self.channel.send(code, self._seq, tensors)
                self.sock.sendall(b"\x01")  # the doorbell: the server posts its receives now
                sent.wait()
        except (WireError, OSError) as exc:
            self._broken = f"{type(exc).__name__}: {exc}"
            raise DraftLaneError(f"the draft server at {self.address} is unreachable ({exc})") from exc

    def post(self, method: Method, *args) -> None:
        """Send ``server.method(*args)``; it runs there while the caller goes on."""
        self._send(method, POST + METHODS.index(method), args)

    def call(self, method: Method, *args, timeout_s: float | None = None):
        """Run ``server.method(*args)`` on the server (after what was posted) and return its result."""
        index = METHODS.index(method)
        self._send(method, CALL + index, args)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        waited = 0.0
        self._broken = "a reply is outstanding"  # until it has arrived whole (an interrupt leaves it so)
        while not select.select([self.sock], [], [], POLL_S)[0]:
            waited += POLL_S
            if waited > timeout_s:
                raise DraftLaneError(
                    f"the draft server at {self.address} gave no answer to {method.value} within "
                    f"{timeout_s:.1f}s"
                )
        try:
            with uninterrupted():
                if not self.sock.recv(1):
                    raise DraftLaneError(
                        f"the draft server at {self.address} closed the connection (it stopped or died)"
                    )
                with traced(self.recorder, "host", "recv"):
                    message = self.channel.recv({REPLY + index, ERROR}, seq=self._seq)
                    result = (
                        None
                        if message.code == ERROR
                        else decode_result(method, message.tensors, self.bounds, self.endpoint.device)
                    )
        except (WireError, OSError) as exc:
            raise DraftLaneError(f"bad reply from the draft server at {self.address}: {exc}") from exc
        self._broken = None
        if message.code == ERROR:
            text = decode_text(message.tensors[0] if message.tensors else None, "error")
            raise DraftLaneError(f"the draft server failed in {method.value}: {text[:2000]}")
        return result

    def settle(self) -> None:
        """Nothing to wait for here: the server's unneeded build ends on its own."""

    def take_trace(self) -> list[dict]:
        """The server's events on this host's clock (the offset measured at connect subtracted and noted in
        ``clock``); recording stops."""
        part = self.call(Method.TRACE_TAKE)
        if part is None:
            return []
        part["events"] = [
            (ph, track, name, stamp - self.offset_ns, args) for ph, track, name, stamp, args in part["events"]
        ]
        part["process"] = f"saguaro draft server at {self.address} (pid {part['pid']})"
        part["clock"] = {
            "source": f"draft server at {self.address}",
            "offset_ns_applied": -self.offset_ns,
            "rtt_ns": self.rtt_ns,
            "how": "NTP-style ping at connect, shortest round trip",
        }
        return [part]

    def close(self) -> None:
        """Close the connection: the server sees end of file and serves the next target."""
        if self.sock is not None:
            try:
                self.sock.close()
            finally:
                self.sock = None
        self.group, self.store = None, None
