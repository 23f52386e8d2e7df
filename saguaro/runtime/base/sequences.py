"""Per-sequence token buffers, lengths, EOS and budgets of one ``generate`` call, and the round's one
device→host read of them. A :class:`SequencePool` keeps the buffers' addresses across generations, as a
``KVPool`` does the caches, so CUDA graphs of a round replay (``saguaro.lower.cuda_graphs``)."""

from __future__ import annotations

import weakref

import torch

from saguaro.runtime.base.kv_store import KVPool, stream_key
from saguaro.tensor_math.ar_round import append_token
from saguaro.tensor_math.verify_round import append_tokens


def host_to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a host sync (pinned and ``non_blocking`` on CUDA)."""
    device = torch.device(device)
    if device.type == "cuda":
        return values.pin_memory().to(device, non_blocking=True)
    return values.to(device)


class _Buffers:
    """One batch's buffers: tokens ``[B, C]``; lengths, finished, padding ``[B]``; end; steps ``[C]``."""

    def __init__(self, batch: int, capacity: int, device: torch.device):
        self.tokens = torch.empty((batch, capacity), dtype=torch.long, device=device)  # [B, C]
        self.lengths = torch.empty(batch, dtype=torch.long, device=device)  # [B]
        self.finished = torch.empty(batch, dtype=torch.bool, device=device)  # [B]
        self.padding = torch.empty(batch, dtype=torch.long, device=device)  # [B]
        self.end = torch.empty((), dtype=torch.long, device=device)  # []
        self.steps = torch.arange(capacity, device=device)  # [C]


class SequencePool(KVPool):
    """Free :class:`SequenceBatch` buffers by (device, batch, capacity, stream, inference mode)."""

    @staticmethod
    def key(batch: int, capacity: int, device: torch.device) -> tuple:
        device = torch.device(device)
        return (str(device), batch, capacity, stream_key(device), torch.is_inference_mode_enabled())


class SequenceBatch:
    """Token buffer ``[B, capacity]``, left-padded prompts, a token's index its KV slot. Row ``b`` holds
    ``lengths[b]`` tokens, the last the pending ``r`` (in no KV store yet); finished rows never grow. The
    host view of ``finished`` and ``lengths`` is the last :meth:`read`'s; a change makes it stale."""

    def __init__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        max_new_tokens: int,
        capacity: int,
        eos_token_ids: list[int],
        pad_token_id: int,
        pool: SequencePool | None = None,
    ):
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
        if pool is not None:  # holds the buffers, not the batch; never at exit
            weakref.finalize(self, pool.give, key, buffers).atexit = False
        self._host: tuple[list, list] | None = ([False] * B, [T] * B)  # (finished, lengths) on the host
        self._eos_tables: dict = {}  # vocabulary size -> [V] bool
        # the next round's inputs SD's round stage made for the current lengths, or None
        self.next_inputs = None

    def buffers(self) -> tuple:
        """``tokens [B, C], lengths [B], padding [B], steps [C]``: what :meth:`over` takes."""
        return self.tokens, self.lengths, self.padding, self._steps

    @classmethod
    def over(cls, tokens, lengths, padding, steps) -> SequenceBatch:
        """A batch over :meth:`buffers` for its index and gather methods only (SD's graphed round)."""
        seqs = cls.__new__(cls)
        seqs.tokens, seqs.lengths, seqs.padding, seqs._steps = tokens, lengths, padding, steps
        seqs.next_inputs = None  # the round's inputs come from these buffers
        return seqs

    @classmethod
    def gathered(
        cls, parts: list, capacity: int, end: int, pool: SequencePool | None = None
    ) -> SequenceBatch:
        """A batch of the rows of ``parts`` in order (``(batch, rows)``, ``rows`` a list or None for all) with
        ``capacity`` columns (theirs past it: padding), every row ending at ``end``, ``prompt_len`` 0."""
        first = parts[0][0]
        picked = [
            (b, None if rows is None else torch.tensor(rows, dtype=torch.long, device=b.tokens.device))
            for b, rows in parts
        ]
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
            seqs.tokens[start : start + taken.shape[0], :S].copy_(taken)
            start += taken.shape[0]
        for name in ("lengths", "finished", "padding"):  # [B] each
            values = [
                getattr(b, name) if rows is None else getattr(b, name).index_select(0, rows)
                for b, rows in picked
            ]
            setattr(seqs, name, getattr(buffers, name).copy_(torch.cat(values)))
        seqs.eos, seqs._eos_tables = first.eos, {}
        seqs.end, seqs._steps = buffers.end.fill_(end), buffers.steps  # [], [C]
        if pool is not None:
            weakref.finalize(seqs, pool.give, key, buffers).atexit = False
        seqs._host, seqs.next_inputs = None, None
        return seqs

    def put_row(self, index: int, other: SequenceBatch) -> None:
        """Row ``index`` becomes ``other``'s only row in place; ``other``'s columns past this capacity must be
        padding."""
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
        """The one device→host read: refresh the host view, return the ``extra`` tensors ``[B]`` in lists."""
        packed = torch.stack(
            [self.finished.long(), self.lengths, *(e.long() for e in extra)]
        ).tolist()  # [2+E, B]
        self._host = ([bool(f) for f in packed[0]], packed[1])
        return packed[2:]

    def _host_view(self) -> tuple[list, list]:
        if self._host is None:
            self.read()
        return self._host

    @property
    def host_active(self) -> list[bool]:
        """Which rows are active ``[B]``, on the host (reads once if the view is stale)."""
        return [not f for f in self._host_view()[0]]

    @property
    def host_lengths(self) -> list[int]:
        """Tokens per row ``[B]``, on the host (reads once if the view is stale)."""
        return list(self._host_view()[1])

    def all_finished(self) -> bool:
        return all(self._host_view()[0])

    def positions(self, index: torch.Tensor) -> torch.Tensor:
        """Model positions of token indices ``[B, T]``: index minus left padding, negative on padding (so a
        slot claimed there is masked from the start)."""
        return index - self.padding[:, None]  # padding indices come out negative

    def prompt_positions(self) -> torch.Tensor:
        index = self._steps[: self.prompt_len].expand(self.batch, -1)
        return self.positions(index).clamp_min(-1)  # [B, T]

    def tail_index(self, count: int) -> torch.Tensor:
        """Indices of the last ``count`` tokens of each row, ``[B, count]``."""
        if count == 1:  # the pending token (AR's round): two operations
            return (self.lengths - 1)[:, None]
        return self.lengths[:, None] - count + self._steps[None, :count]

    def forward_index(self, count: int) -> torch.Tensor:
        """Indices of the pending token and the ``count - 1`` slots after it, ``[B, count]``."""
        return self.lengths[:, None] - 1 + self._steps[None, :count]

    def gather(self, index: torch.Tensor) -> torch.Tensor:
        return self.tokens.gather(1, index)

    def append(self, candidates: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Append the first ``counts[b]`` of ``candidates [B, n]`` to each active row, stopping at EOS (kept)
        and ``max_new_tokens``; how many each row took ``[B]``. Device work only (``append_tokens``, as in
        SD's greedy round stage); the host view is stale until the next :meth:`read`."""
        taken, lengths, finished = append_tokens(
            self.tokens,
            self.lengths,
            self.finished,
            candidates,
            counts,
            torch.isin(candidates, self.eos),
            self.end,
        )
        self.lengths.copy_(lengths)
        self.finished.copy_(finished)
        self.changed()
        return taken

    def append_one(self, token: torch.Tensor) -> None:
        """``append(token[:, None], ones)`` for ``token [B]`` in fewer tensor operations, as AR's round stage
        does (AR's round is host-bound on a CPU)."""
        # AR's host work, see docs/measurements/2026-12-07-figures-from-runtime-base-draft-lanes.md
        lengths, finished = append_token(
            self.tokens, self.lengths, self.finished, token, torch.isin(token, self.eos), self.end
        )
        self.lengths.copy_(lengths)
        self.finished.copy_(finished)
        self.changed()

    def eos_table(self, vocab_size: int) -> torch.Tensor:
        """``[vocab_size]`` bool, True at the EOS ids; made once per vocabulary size."""
        table = self._eos_tables.get(vocab_size)
        if table is None:
            table = torch.zeros(vocab_size + 1, dtype=torch.bool, device=self.eos.device)  # [V + 1]
            # ids outside the vocabulary mark the spare last entry: an index, not a mask (no host sync)
            table[torch.where((self.eos >= 0) & (self.eos < vocab_size), self.eos, vocab_size)] = True
            table = self._eos_tables[vocab_size] = table[:vocab_size]
        return table

    def set_lengths_and_finished(
        self, lengths: torch.Tensor, finished: torch.Tensor, next_inputs=None
    ) -> None:
        """Take a round stage's new ``lengths`` and ``finished`` ``[B]`` and, from SD's, the next round's
        inputs (:attr:`next_inputs`); the host view is stale until the next :meth:`read`."""
        self.lengths, self.finished = lengths, finished
        self.changed()
        self.next_inputs = next_inputs

    def changed(self) -> None:
        """The buffers changed: the host view is stale and :attr:`next_inputs` is dropped."""
        self._host = None
        self.next_inputs = None

    def read_outcome(self, outcome: torch.Tensor) -> list[list[int]]:
        """:meth:`read` of a round's ``outcome [2+E, B]`` packed on the device (finished flags, lengths, ``E``
        more rows, as SD's round stage returns it); the ``E`` rows as lists."""
        packed = outcome.tolist()
        self._host = ([bool(f) for f in packed[0]], packed[1])
        return packed[2:]

    def result(self) -> torch.Tensor:
        """``[B, T + max generated]``, finished rows padded, as ``transformers.generate`` returns."""
        return self.tokens[:, : max(self.host_lengths)].clone()
