"""KV stores at fixed addresses: a store made with a KVPool gives its tensors back when it is collected,
and the next store of the same shape takes them (same data_ptr), reset to a fresh store's contents."""

import gc

import pytest
import torch

from saguaro.runtime.base import kv_store
from saguaro.runtime.base.kv_store import KVPool, KVStore
from tests.passes.stage_helpers import base_graph


def spec():
    return base_graph()[1].spec


def tensors(store: KVStore) -> list:
    return [*store.k_caches, *store.v_caches, store.slot_pos, store.slot_branch]


def scribble(store: KVStore) -> None:
    """What a generation leaves behind: cache values, claimed and tree slots."""
    for cache in (*store.k_caches, *store.v_caches):
        cache.normal_()
    slots = torch.arange(5).expand(store.slot_pos.shape[0], 5)
    store.claim(slots, slots + 3, torch.ones_like(slots))


def assert_fresh(store: KVStore, batch: int, capacity: int) -> None:
    fresh = KVStore(spec(), batch, capacity)
    for got, want in zip(tensors(store), tensors(fresh)):
        assert torch.equal(got, want)


def test_the_next_store_of_a_shape_reuses_the_storage_reset():
    pool = KVPool()
    store = KVStore(spec(), 2, 24, pool=pool)
    pointers = [t.data_ptr() for t in tensors(store)]
    scribble(store)
    assert len(pool) == 0
    del store
    assert len(pool) == 1, "a collected store gives its tensors back"
    again = KVStore(spec(), 2, 24, pool=pool)
    assert [t.data_ptr() for t in tensors(again)] == pointers and pool.reused == 1 and len(pool) == 0
    assert_fresh(again, 2, 24)
    rolled = again._slot_index  # the slot numbers come along
    assert torch.equal(rolled, torch.arange(24))


def test_live_stores_and_other_shapes_get_their_own_tensors():
    pool = KVPool()
    first = KVStore(spec(), 2, 24, pool=pool)
    second = KVStore(spec(), 2, 24, pool=pool)  # both alive: never shared
    assert first.k_caches[0].data_ptr() != second.k_caches[0].data_ptr()
    pointer = first.k_caches[0].data_ptr()
    del first
    other = KVStore(spec(), 1, 24, pool=pool)  # another batch: not this shape's tensors
    assert other.k_caches[0].data_ptr() != pointer and len(pool) == 1
    bigger = KVStore(spec(), 2, 32, pool=pool)  # another capacity
    assert bigger.k_caches[0].data_ptr() != pointer and pool.reused == 0
    assert KVStore(spec(), 2, 24, pool=pool).k_caches[0].data_ptr() == pointer


def test_without_a_pool_nothing_is_kept():
    pool = KVPool()
    store = KVStore(spec(), 2, 24)
    del store
    gc.collect()
    assert len(pool) == 0


def test_the_pool_keeps_at_most_max_free_sets_least_recently_freed_first():
    pool = KVPool(max_free=2)
    stores = [KVStore(spec(), 1, 8 * (i + 1), pool=pool) for i in range(3)]
    newest = stores[2].k_caches[0].data_ptr()
    for i in range(3):  # freed in order: capacity 8, 16, 24
        stores[i] = None
    assert len(pool) == 2
    assert KVStore(spec(), 1, 24, pool=pool).k_caches[0].data_ptr() == newest
    assert pool.reused == 1
    with pytest.raises(ValueError, match=r"max_free=-1 is not allowed: it must be an int >= 0"):
        KVPool(max_free=-1)


def test_inference_mode_stores_take_only_inference_tensors():
    pool = KVPool()
    with torch.inference_mode():
        store = KVStore(spec(), 1, 8, pool=pool)
        pointer = store.k_caches[0].data_ptr()
        del store
    outside = KVStore(spec(), 1, 8, pool=pool)  # inference tensors cannot be written outside the mode
    assert outside.k_caches[0].data_ptr() != pointer
    with torch.inference_mode():
        inside = KVStore(spec(), 1, 8, pool=pool)
        assert inside.k_caches[0].data_ptr() == pointer
        scribble(inside)


def test_select_rows_copies_are_not_pooled():
    pool = KVPool()
    store = KVStore(spec(), 2, 8, pool=pool)
    sub = store.select_rows(torch.tensor([1]))
    assert sub.k_caches[0].shape[0] == 1
    del sub
    assert len(pool) == 0


def test_cuda_stores_are_keyed_by_their_stream(monkeypatch):
    class Stream:
        cuda_stream = 1234

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    assert kv_store.stream_key(torch.device("cuda", 0)) == 1234
    assert kv_store.stream_key(torch.device("cpu")) is None
    assert KVPool.key(spec(), 1, 8)[-2] is None  # the tiny model is on CPU
