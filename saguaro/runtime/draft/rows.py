"""Rows joining and leaving the server's running batch between rounds (mode ``ssd``'s continuous batching);
estimator, planner and fallback means carry on; a joining row draws from the server's one generator."""

from __future__ import annotations

import torch

from saguaro.core.stages import DRAFT_PREFILL
from saguaro.runtime.base.sequences import SequenceBatch, host_to_device
from saguaro.runtime.draft.fallback import neural_fallback
from saguaro.runtime.draft.records import NEURAL, GenerateSpec, Speculation


class RowChanges:
    """The row changes of :class:`~saguaro.runtime.draft.server.SpeculationServer`, over its state."""

    def join_rows(self, spec: GenerateSpec, first_tokens: torch.Tensor) -> Speculation:
        """A row joins as the batch's last: ``spec`` its prompt alone (``input_ids [1, T]``), ``first_tokens
        [1]`` the target's first token. It is prefilled and drafted alone, then spliced into the mirror and
        a store of the largest capacity a row needs; returns its first speculation (``[1, K]``), which the
        server also appends to its own. ``ValueError`` for more than one row."""
        if spec.input_ids.shape[0] != 1 or first_tokens.numel() != 1:
            raise ValueError(
                f"join_rows takes one row: input_ids {tuple(spec.input_ids.shape)}, "
                f"{first_tokens.numel()} first tokens"
            )
        device, B = self.device, self.seqs.batch
        one = SequenceBatch(
            spec.input_ids.to(device),
            spec.attention_mask.to(device),
            spec.max_new_tokens,
            spec.capacity,
            spec.eos_token_ids,
            spec.pad_token_id,
        )
        store = self.draft.new_store(1, spec.capacity)
        T = one.prompt_len
        self.draft.run(
            DRAFT_PREFILL,
            store,
            one.tokens[:, :T],
            one.prompt_positions(),
            torch.arange(T, device=device).expand(1, T),
        )
        first = first_tokens.to(device).reshape(1)
        one.append(first[:, None], torch.ones_like(first))
        tokens, probs = neural_fallback(
            self.draft,
            store,
            one,
            torch.zeros(1, dtype=torch.long, device=device),
            self.k,
            self.temperature,
            self.generator,
        )  # [1, K], [1, K, V] or None
        self._take([(self.seqs, None, self.store), (one, None, store)], self.row_capacity + [spec.capacity])
        current = self.current
        self.current = Speculation(
            torch.cat([current.tokens, tokens]),
            None if probs is None else torch.cat([current.probs, probs]),
            list(current.source) + [NEURAL],
        )
        if self._pending_ranks is not None:  # the new row has no outcome yet
            accepted, ranks = self._pending_ranks
            self._pending_ranks = (list(accepted) + [None], torch.cat([ranks, ranks.new_zeros(1)]))
        self.policy.batch = B + 1
        return Speculation(tokens, probs, [NEURAL])

    def keep_rows(self, rows: list) -> None:
        """Keep ``rows`` (host ints, increasing, at least one) in order, the others leave: mirror, store
        (narrowed to the capacity they need), speculation, pending ranks, policy batch; ``ValueError``
        otherwise."""
        B = self.seqs.batch
        if not rows or sorted(set(rows)) != list(rows) or not 0 <= rows[0] <= rows[-1] < B:
            raise ValueError(f"keep_rows takes increasing row indices in [0, {B}), at least one; got {rows}")
        index = host_to_device(torch.tensor(rows, dtype=torch.long, device="cpu"), self.device)  # [M]
        self._take([(self.seqs, rows, self.store)], [self.row_capacity[b] for b in rows])
        current = self.current
        self.current = Speculation(
            current.tokens.index_select(0, index),
            None if current.probs is None else current.probs.index_select(0, index),
            [current.source[b] for b in rows],
        )
        if self._pending_ranks is not None:
            accepted, ranks = self._pending_ranks
            self._pending_ranks = ([accepted[b] for b in rows], ranks.index_select(0, index))
        self.policy.batch = len(rows)

    def _take(self, parts: list, capacities: list) -> None:
        """The running batch becomes the rows of ``parts`` (``(SequenceBatch, rows or None, KVStore)``), in a
        mirror and a store of the largest of ``capacities`` slots."""
        capacity = max(capacities)
        seqs = SequenceBatch.gathered([(s, rows) for s, rows, _ in parts], capacity, capacity)
        store = self.draft.new_store(seqs.batch, capacity).take_rows(
            [
                (
                    st,
                    None
                    if rows is None
                    else host_to_device(
                        torch.tensor(rows, dtype=torch.long, device="cpu"), st.slot_pos.device
                    ),
                )
                for _, rows, st in parts
            ]
        )
        self.seqs, self.store, self.row_capacity, self.cache = seqs, store, list(capacities), None
