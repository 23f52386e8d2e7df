"""Rows joining and leaving the server's running batch between rounds: continuous batching for mode ``ssd``
(:class:`~saguaro.runtime.batching.BatchSession`).

Between two rounds the lane is idle (a round's ``match`` and ``fallback`` wait for its ``build``), so the
running batch changes only there:

- :meth:`RowChanges.join_rows` prefills one new row alone, as ``open`` does for a generation of it alone,
  decodes its first speculation as ``start`` does (batch 1), and splices its row after the running rows:
  the mirror's buffers (``SequenceBatch.gathered``) and the draft's store (``KVStore.take_rows``, into a
  store of the largest capacity a row needs). The caller appends the returned ``[1, K]`` speculation to
  the one it will verify next, as the server appends it to its own.
- :meth:`RowChanges.keep_rows` keeps the rows named, in order: the mirror, the store (narrowed to the
  capacity the kept rows need), the next round's speculation, the ranks an outcome left for the next
  build to read, and the batch size the fallback policy chooses by.

The speculation cache of the last build is dropped (the next build makes a new one); the estimator, the
planner and the fallback policy's running means are the batch's, not a row's, and carry on. Sampled, a
joining row draws from the server's one generator: only a generation alone gives a seeded request the
tokens ``generate`` gives it (``saguaro serve`` runs those alone).
"""

from __future__ import annotations

import torch

from saguaro.core.stages import DRAFT_PREFILL
from saguaro.runtime.base.sequences import SequenceBatch, host_to_device
from saguaro.runtime.draft.fallback import neural_fallback
from saguaro.runtime.draft.records import NEURAL, GenerateSpec, Speculation


class RowChanges:
    """The row changes of :class:`~saguaro.runtime.draft.server.SpeculationServer` (its state: ``seqs``,
    ``store``, ``current``, ``row_capacity``, ``policy``, ``_pending_ranks``, ``cache``)."""

    def join_rows(self, spec: GenerateSpec, first_tokens: torch.Tensor) -> Speculation:
        """A row joins: ``spec`` its prompt alone (``input_ids [1, T]``, its capacity and budget), ``first_tokens
        [1]`` the target's first token for it. Returns its first speculation (tokens ``[1, K]``); the row is the
        batch's last."""
        if spec.input_ids.shape[0] != 1 or first_tokens.numel() != 1:
            raise ValueError(f"join_rows takes one row: input_ids {tuple(spec.input_ids.shape)}, "
                             f"{first_tokens.numel()} first tokens")
        device, B = self.device, self.seqs.batch
        one = SequenceBatch(spec.input_ids.to(device), spec.attention_mask.to(device), spec.max_new_tokens,
                            spec.capacity, spec.eos_token_ids, spec.pad_token_id)
        store = self.draft.new_store(1, spec.capacity)
        T = one.prompt_len
        self.draft.run(DRAFT_PREFILL, store, one.tokens[:, :T], one.prompt_positions(),
                       torch.arange(T, device=device).expand(1, T))
        first = first_tokens.to(device).reshape(1)
        one.append(first[:, None], torch.ones_like(first))
        tokens, probs = neural_fallback(self.draft, store, one, torch.zeros(1, dtype=torch.long, device=device),
                                        self.k, self.temperature, self.generator)  # [1, K], [1, K, V] or None
        self._take([(self.seqs, None, self.store), (one, None, store)], self.row_capacity + [spec.capacity])
        current = self.current
        self.current = Speculation(torch.cat([current.tokens, tokens]),
                                   None if probs is None else torch.cat([current.probs, probs]),
                                   list(current.source) + [NEURAL])
        if self._pending_ranks is not None:  # the new row has no outcome yet
            accepted, ranks = self._pending_ranks
            self._pending_ranks = (list(accepted) + [None], torch.cat([ranks, ranks.new_zeros(1)]))
        self.policy.batch = B + 1
        return Speculation(tokens, probs, [NEURAL])

    def keep_rows(self, rows: list) -> None:
        """Keep the rows ``rows`` (host ints, increasing, at least one), in that order; the others leave."""
        B = self.seqs.batch
        if not rows or sorted(set(rows)) != list(rows) or not 0 <= rows[0] <= rows[-1] < B:
            raise ValueError(f"keep_rows takes increasing row indices in [0, {B}), at least one; got {rows}")
        index = host_to_device(torch.tensor(rows, dtype=torch.long, device="cpu"), self.device)  # [M]
        self._take([(self.seqs, rows, self.store)], [self.row_capacity[b] for b in rows])
        current = self.current
        self.current = Speculation(current.tokens.index_select(0, index),
                                   None if current.probs is None else current.probs.index_select(0, index),
                                   [current.source[b] for b in rows])
        if self._pending_ranks is not None:
            accepted, ranks = self._pending_ranks
            self._pending_ranks = ([accepted[b] for b in rows], ranks.index_select(0, index))
        self.policy.batch = len(rows)

    def _take(self, parts: list, capacities: list) -> None:
        """The running batch is now the rows of ``parts`` (``(SequenceBatch, row indices or None, KVStore)``),
        in a mirror and a store of the largest of ``capacities`` (each row's) slots."""
        capacity = max(capacities)
        seqs = SequenceBatch.gathered([(s, rows) for s, rows, _ in parts], capacity, capacity)
        store = self.draft.new_store(seqs.batch, capacity).take_rows(
            [(st, None if rows is None else host_to_device(torch.tensor(rows, dtype=torch.long, device="cpu"),
                                                            st.slot_pos.device)) for _, rows, st in parts])
        self.seqs, self.store, self.row_capacity, self.cache = seqs, store, list(capacities), None
