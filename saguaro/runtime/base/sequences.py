"""Per-sequence token buffers, lengths, EOS and budgets for one ``generate`` call, and the one
device→host read each round makes of them.

A :class:`SequenceBatch` made with a :class:`SequencePool` keeps its buffers at fixed addresses across
generations, as a ``KVStore`` with a ``KVPool`` does: AR's round writes the token buffer in place, so a
CUDA graph of the round (``saguaro.lower.cuda_graphs``) captured in one generation replays in every later
one of the same batch and capacity.
"""

from __future__ import annotations

import weakref

import torch

from saguaro.runtime.base.kv_store import KVPool, stream_key
from saguaro.tensor_math.ar_round import append_token
from saguaro.tensor_math.verify_round import append_tokens


def host_to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor (host bookkeeping: row indices, outcomes) on ``device`` without a host sync: on
    CUDA it is pinned and copied ``non_blocking`` (a pageable copy waits for the stream); elsewhere the
    tensor itself or a plain copy."""
    device = torch.device(device)
    if device.type == "cuda":
        return values.pin_memory().to(device, non_blocking=True)
    return values.to(device)


class _Buffers:
    """One batch's device buffers: tokens ``[B, C]``, lengths, finished, padding ``[B]``, end ``[]``, steps ``[C]``."""

    def __init__(self, batch: int, capacity: int, device: torch.device):
        self.tokens = torch.empty((batch, capacity), dtype=torch.long, device=device)  # [B, C]
        self.lengths = torch.empty(batch, dtype=torch.long, device=device)  # [B]
        self.finished = torch.empty(batch, dtype=torch.bool, device=device)  # [B]
        self.padding = torch.empty(batch, dtype=torch.long, device=device)  # [B]
        self.end = torch.empty((), dtype=torch.long, device=device)  # []
        self.steps = torch.arange(capacity, device=device)  # [C]


class SequencePool(KVPool):
    """Free :class:`SequenceBatch` buffers by (device, batch, capacity, stream, inference mode), handed to the
    next batch of that shape: the same addresses, generation after generation (thread-safe, bounded)."""

    @staticmethod
    def key(batch: int, capacity: int, device: torch.device) -> tuple:  # noqa: D102 - KVPool.key's, for buffers
        device = torch.device(device)
        return (str(device), batch, capacity, stream_key(device), torch.is_inference_mode_enabled())


class SequenceBatch:
    """Token buffer ``[B, capacity]`` with left-padded prompts; a token's index is also its KV slot.

    Row ``b`` holds ``lengths[b]`` tokens; the last one is the pending token ``r`` (decided, not yet in
    any KV store). Finished rows (EOS or ``max_new_tokens`` reached) are never extended.

    The buffers live on the device; the host keeps a view of ``finished`` and ``lengths`` as of the
    last :meth:`read` (one device→host transfer, the round's outcome read with them), so the host's
    questions (:meth:`all_finished`, :attr:`host_active`) cost no sync. :meth:`append` makes the view
    stale; a question asked then reads once. With ``pool``, the buffers come from (and, once the batch is
    garbage collected, go back to) the pool.
    """

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                 capacity: int, eos_token_ids: list[int], pad_token_id: int, pool: SequencePool | None = None):
        B, T = input_ids.shape
        dev = input_ids.device
        self.prompt_len = T
        self.max_new_tokens = max_new_tokens
        self.pad_token_id = pad_token_id
        key = SequencePool.key(B, capacity, dev)
        buffers = pool.take(key) if pool is not None else None
        if buffers is None:
            buffers = _Buffers(B, capacity, dev)
        self.tokens = buffers.tokens.fill_(pad_token_id)  # [B, C]
        self.tokens[:, :T] = input_ids
        self.pad_mask = attention_mask == 0  # [B, T]
        self.padding = buffers.padding.copy_(self.pad_mask.sum(dim=1))  # [B] left-pad counts
        self.lengths = buffers.lengths.fill_(T)  # [B]
        self.finished = buffers.finished.zero_()  # [B]
        self.eos = host_to_device(torch.tensor(eos_token_ids, dtype=torch.long, device="cpu"), dev)  # [E]
        # the length at which a row has its max_new_tokens, as a tensor: a graph input of AR's round stage
        self.end = buffers.end.fill_(T + max_new_tokens)  # []
        # the step index every tail / forward index slices ([0, C)): no arange per call
        self._steps = buffers.steps  # [C]
        if pool is not None:  # holds the buffers, not the batch; never at exit (the pool dies with the process)
            weakref.finalize(self, pool.give, key, buffers).atexit = False
        self._host: tuple[list, list] | None = ([False] * B, [T] * B)  # (finished, lengths) on the host
        self._eos_tables: dict = {}  # vocabulary size -> [V] bool
        # the next round's inputs made on the device by SD's round stage for the current lengths, or None
        self.next_inputs = None

    def buffers(self) -> tuple:
        """``tokens [B, C], lengths [B], padding [B], steps [C]``: what :meth:`over` takes."""
        return self.tokens, self.lengths, self.padding, self._steps

    @classmethod
    def over(cls, tokens, lengths, padding, steps) -> "SequenceBatch":
        """A batch over :meth:`buffers`, for its index and gather methods only (SD's graphed round)."""
        seqs = cls.__new__(cls)
        seqs.tokens, seqs.lengths, seqs.padding, seqs._steps = tokens, lengths, padding, steps
        seqs.next_inputs = None  # the round's inputs come from these buffers
        return seqs

    @classmethod
    def gathered(cls, parts: list, capacity: int, end: int, pool: SequencePool | None = None) -> "SequenceBatch":
        """A batch of the rows of ``parts``, one part after another: ``(batch, rows)``, ``rows`` a list of that
        batch's row indices or None for all of them; ``capacity`` columns (a part's columns past it must be
        padding), ``end`` the length at which every row finishes (continuous batching, ``runtime.batching``,
        keeps each row's own budget on the host). Rows of several prompt lengths: ``prompt_len`` is 0, each
        row's ``padding`` gives its positions. With ``pool``, the buffers are pooled as ``__init__``'s."""
        first = parts[0][0]
        picked = [(b, None if rows is None else torch.tensor(rows, dtype=torch.long, device=b.tokens.device))
                  for b, rows in parts]
        B, dev = sum(b.batch if rows is None else rows.numel() for b, rows in picked), first.tokens.device
        key = SequencePool.key(B, capacity, dev)
        buffers = pool.take(key) if pool is not None else None
        if buffers is None:
            buffers = _Buffers(B, capacity, dev)
        seqs = cls.__new__(cls)
        seqs.prompt_len, seqs.max_new_tokens, seqs.pad_token_id = 0, end, first.pad_token_id
        seqs.tokens = buffers.tokens.fill_(first.pad_token_id)  # [B, C]
        start = 0
        for b, rows in picked:
            S = min(b.tokens.shape[1], capacity)
            taken = b.tokens[:, :S] if rows is None else b.tokens[:, :S].index_select(0, rows)  # [M, S]
            seqs.tokens[start:start + taken.shape[0], :S].copy_(taken)
            start += taken.shape[0]
        for name in ("lengths", "finished", "padding"):  # [B] each
            values = [getattr(b, name) if rows is None else getattr(b, name).index_select(0, rows) for b, rows in picked]
            setattr(seqs, name, getattr(buffers, name).copy_(torch.cat(values)))
        seqs.eos, seqs._eos_tables = first.eos, {}
        seqs.end, seqs._steps = buffers.end.fill_(end), buffers.steps  # [], [C]
        if pool is not None:
            weakref.finalize(seqs, pool.give, key, buffers).atexit = False
        seqs._host, seqs.next_inputs = None, None
        return seqs

    def put_row(self, index: int, other: "SequenceBatch") -> None:
        """Row ``index`` becomes ``other``'s only row (its tokens, length, flags, padding; columns past
        ``other``'s are padding; ``other``'s past this batch's capacity must be padding too), in place: the other
        rows and the buffers' addresses stay (continuous batching, ``runtime.batching``)."""
        S = min(other.tokens.shape[1], self.tokens.shape[1])
        self.tokens[index].fill_(self.pad_token_id)  # [C]
        self.tokens[index, :S].copy_(other.tokens[0, :S])
        for name in ("lengths", "finished", "padding"):  # [B] each
            getattr(self, name)[index].copy_(getattr(other, name)[0])
        self.changed()

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]

    @property
    def generated(self) -> torch.Tensor:
        return self.lengths - self.prompt_len  # [B]

    @property
    def active(self) -> torch.Tensor:
        return ~self.finished  # [B]

    def read(self, *extra: torch.Tensor) -> list[list[int]]:
        """The one device→host read: refresh the host view of ``finished`` and ``lengths`` and return
        the ``extra`` integer tensors ``[B]`` as lists, all in one transfer."""
        packed = torch.stack([self.finished.long(), self.lengths, *(e.long() for e in extra)]).tolist()  # [2+E, B]
        self._host = ([bool(f) for f in packed[0]], packed[1])
        return packed[2:]

    def _host_view(self) -> tuple[list, list]:
        if self._host is None:
            self.read()
        return self._host

    @property
    def host_active(self) -> list[bool]:
        """Which rows are still active ``[B]``, on the host (reads once if an append made it stale)."""
        return [not f for f in self._host_view()[0]]

    @property
    def host_lengths(self) -> list[int]:
        """Tokens per row ``[B]``, on the host (reads once if an append made it stale)."""
        return list(self._host_view()[1])

    def all_finished(self) -> bool:
        return all(self._host_view()[0])

    def positions(self, index: torch.Tensor) -> torch.Tensor:
        """Model positions of token indices ``[B, T]``: index minus left padding; -1 on padding.

        A slot claimed at position -1 is invalid, so padding is masked out from the moment it is written.
        """
        return index - self.padding[:, None]  # padding indices come out negative

    def prompt_positions(self) -> torch.Tensor:
        index = self._steps[:self.prompt_len].expand(self.batch, -1)
        return self.positions(index).clamp_min(-1)  # [B, T]

    def tail_index(self, count: int) -> torch.Tensor:
        """Indices of the last ``count`` tokens of each row, ``[B, count]``."""
        if count == 1:  # the pending token (AR's round): two operations
            return (self.lengths - 1)[:, None]
        return self.lengths[:, None] - count + self._steps[None, :count]

    def forward_index(self, count: int) -> torch.Tensor:
        """Indices of the pending token and the ``count - 1`` slots after it, ``[B, count]`` (a
        speculation ``[r, x_1..x_K]`` under verification or glue)."""
        return self.lengths[:, None] - 1 + self._steps[None, :count]

    def gather(self, index: torch.Tensor) -> torch.Tensor:
        return self.tokens.gather(1, index)

    def append(self, candidates: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Append the first ``counts[b]`` of ``candidates [B, n]`` to each active row.

        Stops at EOS (kept) and at ``max_new_tokens``; returns how many tokens each row took ``[B]``.
        Device work only: the host view is stale until the next :meth:`read`. The same function
        (``tensor_math.verify_round.append_tokens``) runs inside SD's greedy round stage.
        """
        taken, lengths, finished = append_tokens(self.tokens, self.lengths, self.finished, candidates, counts,
                                                 torch.isin(candidates, self.eos), self.end)
        self.lengths.copy_(lengths)
        self.finished.copy_(finished)
        self.changed()
        return taken

    def append_one(self, token: torch.Tensor) -> None:
        """``append(token[:, None], ones)`` in a third of the tensor operations (AR's round is host-bound
        on a CPU: measured on the default pair): ``token [B]``, one per active row. The same function
        runs inside AR's greedy round stage (``tensor_math.ar_round``)."""
        lengths, finished = append_token(self.tokens, self.lengths, self.finished, token,
                                         torch.isin(token, self.eos), self.end)
        self.lengths.copy_(lengths)
        self.finished.copy_(finished)
        self.changed()

    def eos_table(self, vocab_size: int) -> torch.Tensor:
        """``[vocab_size]`` bool, True at the EOS ids (the round stages look their tokens up there); made once
        per vocabulary size."""
        table = self._eos_tables.get(vocab_size)
        if table is None:
            table = torch.zeros(vocab_size + 1, dtype=torch.bool, device=self.eos.device)  # [V + 1]
            # ids outside the vocabulary mark the spare last entry: an index, not a boolean mask (no host sync)
            table[torch.where((self.eos >= 0) & (self.eos < vocab_size), self.eos, vocab_size)] = True
            table = self._eos_tables[vocab_size] = table[:vocab_size]
        return table

    def advanced(self, lengths: torch.Tensor, finished: torch.Tensor, next_inputs=None) -> None:
        """Take a round's new ``lengths`` and ``finished`` ``[B]`` (the round stages append inside their graph
        and return them) and, from SD's round stage, the next round's inputs (:attr:`next_inputs`): the host
        view is stale until the next :meth:`read`."""
        self.lengths, self.finished = lengths, finished
        self.changed()
        self.next_inputs = next_inputs

    def changed(self) -> None:
        """The buffers changed: the host view is stale, and round inputs made for the old lengths are gone."""
        self._host = None
        self.next_inputs = None

    def take_outcome(self, outcome: torch.Tensor) -> list[list[int]]:
        """:meth:`read` of a round's ``outcome [2+E, B]`` packed on the device (finished flags, lengths, then
        ``E`` more rows, as SD's round stage returns it): one transfer; returns the ``E`` rows as lists."""
        packed = outcome.tolist()
        self._host = ([bool(f) for f in packed[0]], packed[1])
        return packed[2:]

    def result(self) -> torch.Tensor:
        """``[B, T + max generated]`` with finished rows padded, as ``transformers.generate`` returns."""
        return self.tokens[:, : max(self.host_lengths)].clone()
