"""Streaming: each round's tokens, handed out as soon as the round has decided them.

Every decoder calls ``DecodeState.round_committed`` once a round's tokens are appended (the prefill too).
That hook feeds ``generate``'s ``on_round`` and ``streamer``, and :class:`TokenStream`, which runs
``generate`` on a worker thread in strict turns with its reader and holds the Program's lock until it ends.
The contract a user sees in full: docs/api.md, "Streaming: program.stream".
"""

from __future__ import annotations

import inspect
import sys
import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from saguaro.core.errors import SaguaroError
from saguaro.core.openmp import release_thread_pool

_READING: dict = {}  # (id of a Program's lock, thread id) -> how many of its streams that thread reads now


@dataclass(frozen=True)
class RoundTokens:
    """The tokens one round decided: ``round`` (0: the prefill's), ``new_tokens`` (``B`` lists of up to
    ``k + 1`` ids, empty once a row finished) and ``finished [B]``. A row's prompt and all its lists make its
    row of ``generate``'s sequences."""

    round: int
    new_tokens: list
    finished: list


class RoundEmitter:
    """``DecodeState.on_round``: each call reads what every row gained since the last call (one
    device→host copy of ``[B, most gained]`` tokens) and hands it to ``deliver`` as :class:`RoundTokens`."""

    def __init__(self, deliver):
        self.deliver = deliver
        self.emitted: list | None = None  # tokens per row already handed out (prompt included)
        self.rounds = 0

    def __call__(self, seqs) -> None:
        lengths = seqs.host_lengths  # the round's own read (AR: read here, then reused by its next check)
        emitted = self.emitted or [seqs.prompt_len] * len(lengths)
        # k + 1 at most, unless a round was missed
        width = max(length - done for length, done in zip(lengths, emitted))
        new = [[] for _ in lengths]
        if width > 0:
            device = seqs.tokens.device
            starts = torch.tensor(emitted, device=device)[:, None]
            index = starts + torch.arange(width, device=device)[None, :]
            window = seqs.tokens.gather(1, index.clamp_max(seqs.tokens.shape[1] - 1)).tolist()  # [B, width]
            new = [row[: length - done] for row, done, length in zip(window, emitted, lengths)]
        self.emitted = lengths
        chunk = RoundTokens(self.rounds, new, [not active for active in seqs.host_active])
        self.rounds += 1
        self.deliver(chunk)


class StreamerFeed:
    """A ``transformers`` streamer fed from :class:`RoundTokens` (batch 1): the prompt, then each round."""

    def __init__(self, streamer, input_ids):
        if not (callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))):
            raise ValueError(
                f"streamer={type(streamer).__name__} is not allowed: give a transformers streamer "
                "(an object with put(token_ids) and end(), e.g. TextStreamer)"
            )
        prompt = (
            input_ids if isinstance(input_ids, torch.Tensor) else torch.as_tensor(input_ids, device="cpu")
        )
        prompt = prompt[None] if prompt.dim() == 1 else prompt
        if prompt.dim() == 2 and prompt.shape[0] != 1:
            raise ValueError(
                f"streamer= takes one sequence, as in transformers (input_ids [1, T]); got a batch of "
                f"{prompt.shape[0]}: use program.stream(...) to stream a batch"
            )
        self.streamer = streamer
        self.prompt = prompt.detach().cpu()

    def __call__(self, chunk: RoundTokens) -> None:
        if chunk.round == 0:
            self.streamer.put(self.prompt)  # [1, T], as transformers puts it
        if chunk.new_tokens[0]:
            self.streamer.put(torch.tensor([chunk.new_tokens[0]], dtype=torch.long, device="cpu"))  # [1, n]


def check_not_reading(lock) -> None:
    """``SaguaroError`` for a call of the Program owning ``lock`` from a thread reading one of its streams
    (the stream holds the lock until it ends: the call would wait forever)."""
    if _READING.get((id(lock), threading.get_ident())):
        raise SaguaroError(
            "this thread is reading a program.stream of this Program, which holds it until the "
            "stream ends: finish or close() the stream first (or call from another thread)"
        )


def first_round_tells(runners, on_round):
    """The round hook of one generation: calls each runner's ``first_tokens_out`` once, at the first round,
    and ``on_round`` (None: not streaming) at every round."""
    untold = list(runners)

    def hook(seqs):
        while untold:
            untold.pop().first_tokens_out()
        if on_round is not None:
            on_round(seqs)

    return hook


@contextmanager
def streaming(streamer, on_round, input_ids):
    """``generate``'s callback for the round hook (None: not streaming); ``streamer.end()`` on the way
    out, whether generate returned or raised. Raises ``ValueError`` for a bad streamer at once."""
    if on_round is not None and not callable(on_round):
        raise ValueError(f"on_round={on_round!r} is not allowed: give a callable taking a RoundTokens")
    feeds = [StreamerFeed(streamer, input_ids)] if streamer is not None else []
    feeds += [on_round] if on_round is not None else []
    try:
        yield RoundEmitter(lambda chunk: [feed(chunk) for feed in feeds]) if feeds else None
    finally:
        if streamer is not None:
            streamer.end()


class StreamClosed(BaseException):
    """Raised on the generating thread, from the round hook, once the reader closed its stream: it
    unwinds ``generate`` like an interrupt (a BaseException: no ``except Exception`` keeps it)."""


class _Turns:
    """Where the worker and the reader meet, in strict turns: the worker runs only while the reader waits."""

    def __init__(self):
        self.cond = threading.Condition()
        self.pending = None  # ("round", RoundTokens) | ("done", GenerateOutput) | ("error", exception)
        self.wanted = False
        self.closed = False

    def hand_over(self, item, last: bool = False) -> None:
        """Worker: give ``item`` to the reader and, unless ``last``, wait until it asks for the next one."""
        with self.cond:
            self.pending, self.wanted = item, False
            self.cond.notify_all()
            if last:
                return
            while not self.wanted and not self.closed:
                self.cond.wait()
            if self.closed:
                raise StreamClosed

    def take(self):
        """Reader: let the worker run until it hands over the next item; return it."""
        with self.cond:
            if self.pending is None:
                self.wanted = True
                self.cond.notify_all()
            while self.pending is None:
                self.cond.wait()
            item, self.pending = self.pending, None
            return item

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()


def _generate_in_turns(program, input_ids, options: dict, turns: _Turns, cuda_stream) -> None:
    """The worker thread's body; it holds no reference to its :class:`TokenStream`, so dropping it closes."""
    try:
        with torch.cuda.stream(cuda_stream) if cuda_stream is not None else nullcontext():
            out = program.generate(
                input_ids, on_round=lambda chunk: turns.hand_over(("round", chunk)), **options
            )
    except StreamClosed:
        return
    except BaseException as exc:
        turns.hand_over(("error", exc), last=True)
        return
    turns.hand_over(("done", out), last=True)


class TokenStream:
    """An iterator of :class:`RoundTokens`, one per round, starting the generation at the first ``next()``.

    ``output``: ``generate``'s result once it has ended (None before, and after an early ``close``). A context
    manager: leaving the block closes it."""

    def __init__(self, program, input_ids, options: dict, lock=None):
        if "on_round" in options:
            raise ValueError(
                "stream() hands each round to its iterator: on_round= is generate's (not stream's)"
            )
        inspect.signature(program.generate).bind(input_ids, **options)  # a wrong name: TypeError now
        device = program.target.spec.device
        cuda_stream = torch.cuda.current_stream(device) if device.type == "cuda" else None  # the reader's
        self._turns = _Turns()
        self._thread = threading.Thread(
            target=_generate_in_turns,
            name="saguaro-stream",
            daemon=True,
            args=(program, input_ids, options, self._turns, cuda_stream),
        )
        self._ended = False
        # no SSD lane decodes beside the stream's thread (mode ssd's does: core/openmp.py, why that matters)
        self._alone = program.config.mode != "ssd"
        self._lock = lock  # the Program's
        self._reader = None  # (id of the lock, id of the reading thread)
        self.output = None

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> RoundTokens:
        if self._ended:
            raise StopIteration
        if self._thread.ident is None:
            check_not_reading(self._lock)  # a stream inside a stream of one Program: the inner one would wait
            self._reader = (id(self._lock), threading.get_ident())
            _READING[self._reader] = _READING.get(self._reader, 0) + 1
            if self._alone:  # the stream's thread decodes: this one's OpenMP workers go (core/openmp.py)
                release_thread_pool()
            self._thread.start()
        try:
            kind, value = self._turns.take()
        except BaseException:  # a Ctrl-C while the generation runs: stop it at its next round, then raise
            self.close()
            raise
        if kind == "round":
            return value
        self._ended = True
        self._thread.join()
        self._stop_reading()
        if kind == "error":
            raise value
        self.output = value
        raise StopIteration

    def close(self) -> None:
        """Stop the generation at its next round boundary and wait for its thread to end (not while the
        interpreter exits: a daemon thread may never run again then)."""
        self._ended = True
        self._turns.close()
        if (
            self._thread.ident is not None
            and self._thread is not threading.current_thread()
            and not sys.is_finalizing()
        ):
            self._thread.join()
        self._stop_reading()

    def _stop_reading(self) -> None:
        # once per stream: the key is shared by the thread's streams of the Program
        if self._reader is not None:
            left = _READING.pop(self._reader, 1) - 1
            if left:
                _READING[self._reader] = left
            self._reader = None

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
