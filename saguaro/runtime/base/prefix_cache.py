"""Prefix caching: the KV of recent prompts, reused by a new prompt that starts with the same tokens.

An entry holds one prompt's tokens (padding left out) and, for each store its prefill filled (the target's, and
the local draft's in SD), the keys and values at positions ``0..n-1``. A one-row prompt of ``T`` tokens reuses
the longest prefix it shares with an entry, at most ``T - 2`` tokens (its last rows are still prefilled: the first
token is decided from them, and a one-row prefill would be a new shape for a compiled stage): those slots are
copied into its fresh stores at its own padded columns and the prefill runs over the rest
(:func:`saguaro.runtime.decode.prefill.prefill`). A key or value depends only on the tokens up to it and their
positions, so the reused slots hold what the whole prefill would have written; the rows prefilled after them
may round differently in the last bits (another row count in a product), as in any prefix cache. Entries are
dropped least recently used first once more than ``max_tokens`` positions are held.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from saguaro.runtime.base.kv_store import KVStore


@dataclass
class _Entry:
    tokens: tuple
    target: list  # per layer: keys then values, [Hkv, n, D] each
    draft: list | None  # as ``target``, or None where no draft store was prefilled


class PrefixCache:
    """The KV of the last prompts, up to ``max_tokens`` positions; ``ValueError`` unless it is an int >= 1."""

    def __init__(self, max_tokens: int):
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens!r} is not allowed: it must be an integer >= 1")
        self.max_tokens = max_tokens
        self.entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self.lookups = self.hits = self.reused_tokens = 0

    @property
    def held_tokens(self) -> int:
        return sum(len(entry.tokens) for entry in self.entries.values())

    def restore(self, tokens: list, column: int, target: KVStore, draft: KVStore | None) -> int:
        """Copy the longest cached prefix of ``tokens`` (a prompt without padding, its first token at store
        ``column``) into row 0 of the fresh stores ``target`` and ``draft`` (None: none); returns its length
        (0: nothing reused). A draft store is filled only from an entry that holds the draft's KV."""
        self.lookups += 1
        best, found = 0, None
        for entry in self.entries.values():
            if draft is not None and entry.draft is None:
                continue
            shared = common_prefix(entry.tokens, tokens)
            if shared > best:
                best, found = shared, entry
        reused = min(best, len(tokens) - 2)
        if reused < 1:
            return 0
        self.entries.move_to_end(found.tokens)
        for store, held in ((target, found.target), (draft, found.draft)):
            if store is None:
                continue
            for cache, part in zip((*store.k_caches, *store.v_caches), held):
                cache[0, :, column : column + reused].copy_(part[:, :reused])
            slots = torch.arange(column, column + reused, device=store.slot_pos.device)[None, :]  # [1, n]
            store.claim(slots, slots - column, torch.zeros_like(slots))
        self.hits += 1
        self.reused_tokens += reused
        return reused

    def keep(self, tokens: list, column: int, target: KVStore, draft: KVStore | None) -> None:
        """Hold the KV of the prefilled prompt ``tokens`` (row 0 of the stores, its first token at ``column``);
        an entry of the same tokens holding as many stores is kept (made the most recent), and the least recently used go past
        ``max_tokens``."""
        key = tuple(tokens)
        held_already = self.entries.get(key)
        if held_already is not None and (draft is None or held_already.draft is not None):
            self.entries.move_to_end(key)  # these tokens' KV, each store's: used again, not copied again
            return
        if len(key) > self.max_tokens:
            return
        n = len(key)

        def held(store):
            return [c[0, :, column : column + n].clone() for c in (*store.k_caches, *store.v_caches)]

        self.entries.pop(key, None)
        self.entries[key] = _Entry(key, held(target), held(draft) if draft is not None else None)
        while self.held_tokens > self.max_tokens:
            self.entries.popitem(last=False)


def common_prefix(a: tuple, b: list) -> int:
    """The number of leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
