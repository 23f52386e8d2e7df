"""The KV store Saguaro owns: per-layer caches and slot metadata. Slot ``i`` of row ``b`` holds token ``i``
of its token buffer (left padding included), tree scratch after the glue. ``slot_pos`` is -1 for empty,
padding and rolled-back slots; ``slot_branch`` 0 for shared slots, ``β`` for branch ``β``."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import torch

from saguaro.capture.export import ModelSpec

MAX_FREE = 4  # free tensor sets a pool keeps, of any shapes; the least recently freed go first


class _Tensors:
    """One store's tensors: caches ``[B, Hkv, S, D]`` per layer and the slot metadata ``[B, S]``."""

    def __init__(self, spec: ModelSpec, batch: int, capacity: int):
        shape = (batch, spec.num_kv_heads, capacity, spec.head_dim)
        dev = spec.device
        self.k_caches = [torch.zeros(shape, dtype=spec.dtype, device=dev) for _ in range(spec.num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=spec.dtype, device=dev) for _ in range(spec.num_layers)]
        self.slot_pos = torch.full((batch, capacity), -1, dtype=torch.long, device=dev)  # [B, S]
        self.slot_branch = torch.zeros(batch, capacity, dtype=torch.long, device=dev)  # [B, S]
        self.slot_index = torch.arange(capacity, device=dev)  # [S]

    def reset(self) -> None:
        """Back to a fresh store's contents: zero caches, every slot empty."""
        for cache in (*self.k_caches, *self.v_caches):
            cache.zero_()
        self.slot_pos.fill_(-1)
        self.slot_branch.zero_()


def stream_key(device: torch.device):
    """The current CUDA stream of ``device`` (None off CUDA): a pool hands tensors back on the freeing
    stream only."""
    if device.type != "cuda":
        return None
    return torch.cuda.current_stream(device).cuda_stream


class KVPool:
    """Free store tensors by shape (device, dtype, geometry, batch, capacity, stream, inference mode), handed
    to the next :class:`KVStore` of that shape at the same addresses (CUDA graphs). Thread-safe, bounded."""

    def __init__(self, max_free: int = MAX_FREE):
        if isinstance(max_free, bool) or not isinstance(max_free, int) or max_free < 0:
            raise ValueError(f"max_free={max_free!r} is not allowed: it must be an int >= 0")
        self.max_free = max_free
        self._free: OrderedDict = OrderedDict()  # (key, serial) -> _Tensors, least recently freed first
        self._serial = 0
        self._lock = threading.RLock()  # re-entrant: a store collected inside take() gives back
        self.reused = 0  # stores that took pooled tensors (tests, logs)

    @staticmethod
    def key(spec: ModelSpec, batch: int, capacity: int) -> tuple:
        # inference tensors can be written in place only under inference mode, normal ones anywhere:
        # a store takes tensors made in the same mode
        return (
            str(spec.device),
            spec.dtype,
            spec.num_layers,
            spec.num_kv_heads,
            spec.head_dim,
            batch,
            capacity,
            stream_key(spec.device),
            torch.is_inference_mode_enabled(),
        )

    def take(self, key: tuple) -> _Tensors | None:
        with self._lock:
            for entry in list(self._free):  # a copy: a collected store may give tensors back meanwhile
                tensors = self._free.pop(entry, None) if entry[0] == key else None
                if tensors is not None:
                    self.reused += 1
                    return tensors
            return None

    def give(self, key: tuple, tensors: _Tensors) -> None:
        with self._lock:
            self._serial += 1
            self._free[(key, self._serial)] = tensors
            while len(self._free) > self.max_free:
                self._free.popitem(last=False)

    def __len__(self) -> int:
        return len(self._free)


class KVStore:
    """Per-layer caches ``[B, Hkv, S, D]`` and their slots' mask description; pooled with ``pool``."""

    def __init__(self, spec: ModelSpec, batch: int, capacity: int, pool: KVPool | None = None):
        tensors = None
        if pool is not None:
            key = KVPool.key(spec, batch, capacity)
            tensors = pool.take(key)
            if tensors is not None:
                tensors.reset()
        if tensors is None:
            tensors = _Tensors(spec, batch, capacity)
        self.k_caches = tensors.k_caches
        self.v_caches = tensors.v_caches
        self.slot_pos = tensors.slot_pos  # [B, S]
        self.slot_branch = tensors.slot_branch  # [B, S]
        self.capacity = capacity
        self._slot_index = tensors.slot_index  # [S]
        if pool is not None:
            # holds the tensors, not the store; never at exit (the pool dies with the process)
            weakref.finalize(self, pool.give, key, tensors).atexit = False

    def tensors(self) -> tuple:
        """Flat: ``slot_pos, slot_branch, slot numbers, *k_caches, *v_caches`` (what :meth:`over` takes)."""
        return (self.slot_pos, self.slot_branch, self._slot_index, *self.k_caches, *self.v_caches)

    @classmethod
    def over(cls, *tensors: torch.Tensor) -> KVStore:
        """A store over :meth:`tensors`' flat tensors (SD's graphed round), never pooled."""
        store = cls.__new__(cls)
        store.slot_pos, store.slot_branch, store._slot_index = tensors[:3]
        layers = (len(tensors) - 3) // 2
        store.k_caches, store.v_caches = list(tensors[3 : 3 + layers]), list(tensors[3 + layers :])
        store.capacity = store.slot_pos.shape[1]
        return store

    def claim(self, write_slots: torch.Tensor, positions: torch.Tensor, branch: torch.Tensor) -> None:
        """Mark ``write_slots [B, T]`` as holding tokens at ``positions`` on ``branch`` (all ``[B, T]``)."""
        self.slot_pos.scatter_(1, write_slots, positions)
        self.slot_branch.scatter_(1, write_slots, branch)

    def invalidate_from(self, lengths: torch.Tensor) -> None:
        """Roll back by length: slots ``>= lengths[b]`` of row ``b`` become empty (``lengths [B]``)."""
        beyond = self._slot_index[None, :] >= lengths[:, None]  # [B, S]
        self.slot_pos.masked_fill_(beyond, -1)
        self.slot_branch.masked_fill_(beyond, 0)

    def select_rows(self, rows: torch.Tensor) -> KVStore:
        """A copy of the store restricted to ``rows [M]`` (caches and slot metadata; never pooled)."""
        sub = KVStore.__new__(KVStore)
        sub.k_caches = [c.index_select(0, rows) for c in self.k_caches]
        sub.v_caches = [c.index_select(0, rows) for c in self.v_caches]
        sub.slot_pos = self.slot_pos.index_select(0, rows)
        sub.slot_branch = self.slot_branch.index_select(0, rows)
        sub.capacity = self.capacity
        sub._slot_index = self._slot_index
        return sub

    def put_row(self, index: int, other: KVStore) -> None:
        """Row ``index`` becomes ``other``'s only row in place (other rows and addresses stay); slots past
        ``other``'s capacity are emptied, and ``other``'s past this capacity must be empty."""
        S = min(other.capacity, self.capacity)
        mine = [cache[index] for cache in (*self.k_caches, *self.v_caches)]  # [Hkv, S', D] each
        theirs = [cache[0, :, :S] for cache in (*other.k_caches, *other.v_caches)]
        # one op for every layer's copy (and one for the zeroing): a row joins between two rounds of a batch
        torch._foreach_copy_(
            [row[:, :S] for row in mine] + [self.slot_pos[index, :S]], theirs + [other.slot_pos[0, :S]]
        )
        self.slot_branch[index, :S].copy_(other.slot_branch[0, :S])
        if S < self.capacity:
            torch._foreach_zero_([row[:, S:] for row in mine] + [self.slot_branch[index, S:]])
            self.slot_pos[index, S:].fill_(-1)

    def emptied_row(self, index: int) -> KVStore:
        """Row ``index`` emptied (zero caches, every slot empty, as a fresh store's) and returned as a one-row store
        over this store's tensors: what is written there is this store's row (a joining row prefilled in place,
        where :meth:`put_row` would copy a one-row store's). Never pooled."""
        caches = [cache[index : index + 1] for cache in (*self.k_caches, *self.v_caches)]  # [1, Hkv, S, D]
        torch._foreach_zero_(caches + [self.slot_branch[index : index + 1]])
        self.slot_pos[index].fill_(-1)
        row = type(self).__new__(type(self))
        layers = len(self.k_caches)
        row.k_caches, row.v_caches = caches[:layers], caches[layers:]
        row.slot_pos, row.slot_branch = self.slot_pos[index : index + 1], self.slot_branch[index : index + 1]
        row.capacity, row._slot_index = self.capacity, self._slot_index
        return row

    def take_rows(self, parts: list) -> KVStore:
        """Fill this store's rows with ``parts`` (``(store, [M] rows or None)``) in order and return it; a
        part's slots past this capacity must be empty, ``ValueError`` unless every row is filled."""
        start = 0
        for store, rows in parts:
            S, M = (
                min(store.capacity, self.capacity),
                store.slot_pos.shape[0] if rows is None else rows.numel(),
            )
            for mine, theirs in zip(
                (*self.k_caches, *self.v_caches, self.slot_pos, self.slot_branch),
                (*store.k_caches, *store.v_caches, store.slot_pos, store.slot_branch),
            ):
                theirs = (
                    theirs[..., :S, :] if theirs.dim() == 4 else theirs[:, :S]
                )  # [M', Hkv, S, D] or [M', S]
                mine_rows = mine[start : start + M]
                (mine_rows[..., :S, :] if mine.dim() == 4 else mine_rows[:, :S]).copy_(
                    theirs if rows is None else theirs.index_select(0, rows)
                )
            start += M
        if start != self.slot_pos.shape[0]:
            raise ValueError(f"take_rows filled {start} rows of a store of {self.slot_pos.shape[0]}")
        return self
