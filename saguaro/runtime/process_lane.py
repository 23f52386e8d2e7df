"""The process lane: the draft server in another process, reached through ``torch.distributed``.

Transport is a gloo process group of two ranks (0: the caller, 1: the draft process) built on a
``TCPStore`` over loopback, without touching the default process group. Per round the caller sends
the outcome and receives the next speculation; the draft process starts building the cache for a
speculation as soon as it has sent it, so the build overlaps the caller's verification.
"""

from __future__ import annotations

import datetime
import logging
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from saguaro.config import SaguaroConfig
from saguaro.runtime.draft_server import SOURCES, GenerateSpec, Resolution, SpeculationServer
from saguaro.runtime.lanes import DraftLaneError

log = logging.getLogger(__name__)

OPEN, OUTCOME, CLOSE = 1, 2, 3
HEADER = 8  # longs: command, B, T, max_new_tokens, capacity, pad id, number of eos ids, seed
FLOATS = 2  # temperature, verify seconds


def _send(pg, tensor):
    pg.send([tensor.contiguous()], 1 - pg.rank(), 0).wait()


def _recv(pg, shape, dtype, timeout=None):
    out = torch.empty(shape, dtype=dtype)
    work = pg.recv([out], 1 - pg.rank(), 0)
    if timeout is None:
        work.wait()
    else:
        work.wait(datetime.timedelta(seconds=timeout))
    return out


def _send_resolution(pg, res: Resolution, finished: bool) -> None:
    kind = -1 if res.fallback_kind is None else SOURCES.index(res.fallback_kind)
    info = torch.cat([res.hit.long(), res.source.long(), torch.tensor([kind, int(finished)])])  # [2B + 2]
    _send(pg, res.tokens.long())
    _send(pg, info)
    _send(pg, torch.tensor([res.fallback_s], dtype=torch.float64))
    if res.probs is not None:
        _send(pg, res.probs.float())


def _recv_resolution(pg, B, K, V, sampled, timeout) -> Resolution:
    tokens = _recv(pg, (B, K), torch.long, timeout)
    info = _recv(pg, (2 * B + 2,), torch.long, timeout)
    spent = float(_recv(pg, (1,), torch.float64, timeout)[0])
    probs = _recv(pg, (B, K, V), torch.float32, timeout) if sampled else None
    kind = int(info[2 * B])
    return Resolution(tokens, probs, info[:B].bool(), info[B:2 * B], None if kind < 0 else SOURCES[kind], spent)


def serve(port: int, draft_model: torch.nn.Module, config: SaguaroConfig, timeout_s: float) -> None:
    """The draft process: capture the draft, then answer OPEN / OUTCOME until CLOSE."""
    from saguaro.compile import build_runner

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=timeout_s))
    store.set("draft_up", "1")  # before the group: the caller waits for this, checking we are alive
    pg = dist.ProcessGroupGloo(store, 1, 2, datetime.timedelta(days=1))  # idle between generations
    server = SpeculationServer(build_runner("draft", draft_model, config.backend, config.attention), config)
    with torch.inference_mode():
        while True:
            header = _recv(pg, (HEADER,), torch.long)
            floats = _recv(pg, (FLOATS,), torch.float64)
            command = int(header[0])
            if command == CLOSE:
                return
            if command == OPEN:
                B, T, max_new, capacity, pad, n_eos, seed = (int(x) for x in header[1:])
                ids = _recv(pg, (B, T), torch.long)
                mask = _recv(pg, (B, T), torch.long)
                eos = _recv(pg, (n_eos,), torch.long).tolist() if n_eos else []
                first = _recv(pg, (B,), torch.long)
                server.open(GenerateSpec(ids, mask, max_new, capacity, eos, pad, float(floats[0]),
                                         None if seed < 0 else seed))
                result = server.start(first)
            else:
                B = server.seqs.batch
                accepted = _recv(pg, (B,), torch.long)
                outcome = _recv(pg, (B,), torch.long)
                result = server.resolve(accepted, outcome, float(floats[1]))
            _send_resolution(pg, result, server.finished)
            if not server.finished:
                server.build()  # overlaps the caller's verification of `result`


class ProcessLane:
    """The draft server in a spawned process; started once per Program and reused."""

    kind = "process"

    def __init__(self, draft_model: torch.nn.Module, config: SaguaroConfig, vocab_size: int, timeout_s: float):
        self.timeout_s = timeout_s
        self.config = config
        self.vocab = vocab_size
        self.store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        started = time.perf_counter()
        self.process = mp.get_context("spawn").Process(
            target=serve, args=(self.store.port, draft_model, config, timeout_s), daemon=True,
            name="saguaro-draft-lane")
        self.process.start()
        self._wait_for_child(started)
        self.pg = dist.ProcessGroupGloo(self.store, 0, 2, datetime.timedelta(seconds=timeout_s))
        log.info("draft process lane up in %.1fs (pid %d)", time.perf_counter() - started, self.process.pid)
        self.batch = None
        self.sampled = False

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

    def _header(self, command, fields=(), temperature=0.0, verify_s=0.0):
        header = torch.zeros(HEADER, dtype=torch.long)
        header[0] = command
        header[1:1 + len(fields)] = torch.tensor(fields, dtype=torch.long)
        _send(self.pg, header)
        _send(self.pg, torch.tensor([temperature, verify_s], dtype=torch.float64))

    def open(self, spec: GenerateSpec, first_tokens: torch.Tensor) -> Resolution:
        def run():
            B, T = spec.input_ids.shape
            self.batch, self.sampled = B, spec.temperature > 0
            seed = -1 if spec.seed is None else spec.seed
            self._header(OPEN, (B, T, spec.max_new_tokens, spec.capacity, spec.pad_token_id,
                                len(spec.eos_token_ids), seed), temperature=spec.temperature)
            _send(self.pg, spec.input_ids.cpu())
            _send(self.pg, spec.attention_mask.cpu())
            if spec.eos_token_ids:
                _send(self.pg, torch.tensor(spec.eos_token_ids, dtype=torch.long))
            _send(self.pg, first_tokens.cpu())
            return _recv_resolution(self.pg, B, self.config.k, self.vocab, self.sampled, self.timeout_s)
        return self._guard(run)

    def begin(self) -> None:
        """Nothing to send: the draft process started building when it sent the speculation."""

    def settle(self) -> None:
        """Nothing to wait for here: the draft process's unneeded build ends on its own."""

    def finish(self, accepted, outcome, verify_s) -> tuple[Resolution, float]:
        def run():
            started = time.perf_counter()
            self._header(OUTCOME, verify_s=verify_s)
            _send(self.pg, accepted.cpu())
            _send(self.pg, outcome.cpu())
            res = _recv_resolution(self.pg, self.batch, self.config.k, self.vocab, self.sampled, self.timeout_s)
            return res, max(0.0, time.perf_counter() - started - res.fallback_s)
        return self._guard(run)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self._header(CLOSE)
            except Exception:  # noqa: BLE001 - closing a broken lane
                pass
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
