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

    def buffers(self) -> tuple:
        """``tokens [B, C], lengths [B], padding [B], steps [C]``: what :meth:`over` takes."""
        return self.tokens, self.lengths, self.padding, self._steps

    @classmethod
    def over(cls, tokens, lengths, padding, steps) -> "SequenceBatch":
        """A batch over :meth:`buffers`, for its index and gather methods only (SD's graphed round)."""
        seqs = cls.__new__(cls)
        seqs.tokens, seqs.lengths, seqs.padding, seqs._steps = tokens, lengths, padding, steps
        return seqs

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
        Device work only: the host view is stale until the next :meth:`read`.
        """
        B, n = candidates.shape
        idx = self._steps[None, :n] if n <= self._steps.numel() else torch.arange(n, device=candidates.device)[None]
        remaining = (self.max_new_tokens - self.generated)[:, None]  # [B, 1]
        take = (idx < counts[:, None]) & (idx < remaining) & self.active[:, None]  # [B, n]
        is_eos = torch.isin(candidates, self.eos) & take
        has_eos = is_eos.any(dim=1)  # [B]
        first_eos = torch.where(has_eos, is_eos.long().argmax(dim=1), torch.full_like(counts, n))
        take &= idx <= first_eos[:, None]
        dest = (self.lengths[:, None] + idx).clamp_max(self.tokens.shape[1] - 1)  # [B, n]
        values = torch.where(take, candidates, self.tokens.gather(1, dest))
        self.tokens.scatter_(1, dest, values)
        taken = take.sum(dim=1)  # [B]
        self.lengths += taken
        self.finished |= has_eos | (self.generated >= self.max_new_tokens)
        self._host = None
        return taken

    def append_one(self, token: torch.Tensor) -> None:
        """``append(token[:, None], ones)`` in a third of the tensor operations (AR's round is host-bound
        on a CPU: measured on the default pair): ``token [B]``, one per active row. The same function
        runs inside AR's greedy round stage (``tensor_math.ar_round``)."""
        lengths, finished = append_token(self.tokens, self.lengths, self.finished, token,
                                         torch.isin(token, self.eos), self.end)
        self.lengths.copy_(lengths)
        self.finished.copy_(finished)
        self._host = None

    def eos_table(self, vocab_size: int) -> torch.Tensor:
        """``[vocab_size]`` bool, True at the EOS ids (AR's round stage looks its tokens up there)."""
        table = torch.zeros(vocab_size + 1, dtype=torch.bool, device=self.eos.device)  # [V + 1]
        # ids outside the vocabulary mark the spare last entry: an index, not a boolean mask (no host sync)
        table[torch.where((self.eos >= 0) & (self.eos < vocab_size), self.eos, vocab_size)] = True
        return table[:vocab_size]

    def advanced(self, lengths: torch.Tensor, finished: torch.Tensor) -> None:
        """Take a round's new ``lengths`` and ``finished`` ``[B]`` (AR's round stage appends inside its graph
        and returns them): the host view is stale until the next :meth:`read`."""
        self.lengths, self.finished = lengths, finished
        self._host = None

    def result(self) -> torch.Tensor:
        """``[B, T + max generated]`` with finished rows padded, as ``transformers.generate`` returns."""
        return self.tokens[:, : max(self.host_lengths)].clone()
