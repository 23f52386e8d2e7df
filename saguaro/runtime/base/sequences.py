"""Per-sequence token buffers, lengths, EOS and budgets for one ``generate`` call."""

from __future__ import annotations

import torch


class SequenceBatch:
    """Token buffer ``[B, capacity]`` with left-padded prompts; a token's index is also its KV slot.

    Row ``b`` holds ``lengths[b]`` tokens; the last one is the pending token ``r`` (decided, not yet in
    any KV store). Finished rows (EOS or ``max_new_tokens`` reached) are never extended.
    """

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int,
                 capacity: int, eos_token_ids: list[int], pad_token_id: int):
        B, T = input_ids.shape
        dev = input_ids.device
        self.prompt_len = T
        self.max_new_tokens = max_new_tokens
        self.pad_token_id = pad_token_id
        self.tokens = torch.full((B, capacity), pad_token_id, dtype=torch.long, device=dev)  # [B, C]
        self.tokens[:, :T] = input_ids
        self.pad_mask = attention_mask == 0  # [B, T]
        self.padding = self.pad_mask.sum(dim=1)  # [B] left-pad counts
        self.lengths = torch.full((B,), T, dtype=torch.long, device=dev)  # [B]
        self.finished = torch.zeros(B, dtype=torch.bool, device=dev)  # [B]
        self.eos = torch.tensor(eos_token_ids, dtype=torch.long, device=dev)  # [E]

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]

    @property
    def generated(self) -> torch.Tensor:
        return self.lengths - self.prompt_len  # [B]

    @property
    def active(self) -> torch.Tensor:
        return ~self.finished  # [B]

    def all_finished(self) -> bool:
        return bool(self.finished.all())

    def positions(self, index: torch.Tensor) -> torch.Tensor:
        """Model positions of token indices ``[B, T]``: index minus left padding; -1 on padding.

        A slot claimed at position -1 is invalid, so padding is masked out from the moment it is written.
        """
        return index - self.padding[:, None]  # padding indices come out negative


    def prompt_positions(self) -> torch.Tensor:
        index = torch.arange(self.prompt_len, device=self.tokens.device).expand(self.batch, -1)
        return self.positions(index).clamp_min(-1)  # [B, T]

    def tail_index(self, count: int) -> torch.Tensor:
        """Indices of the last ``count`` tokens of each row, ``[B, count]``."""
        return self.lengths[:, None] - count + torch.arange(count, device=self.tokens.device)[None, :]

    def gather(self, index: torch.Tensor) -> torch.Tensor:
        return self.tokens.gather(1, index)

    def append(self, candidates: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Append the first ``counts[b]`` of ``candidates [B, n]`` to each active row.

        Stops at EOS (kept) and at ``max_new_tokens``; returns how many tokens each row took ``[B]``.
        """
        B, n = candidates.shape
        idx = torch.arange(n, device=candidates.device)[None, :]  # [1, n]
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
        return taken

    def result(self) -> torch.Tensor:
        """``[B, T + max generated]`` with finished rows padded, as ``transformers.generate`` returns."""
        return self.tokens[:, : int(self.lengths.max())].clone()
