"""Sequence buffers at fixed addresses: a SequenceBatch made with a SequencePool gives its buffers back when
it is collected, and the next batch of the same (batch, capacity, device) takes them (same data_ptr), filled
as a fresh batch's. AR's round writes the token buffer in place, so its CUDA graph replays in later
generations (tests/lower/test_cuda_graph_generation.py)."""

import torch

from saguaro.runtime.base.sequences import SequenceBatch, SequencePool


def buffers(seqs: SequenceBatch) -> list:
    return [seqs.tokens, seqs.lengths, seqs.finished, seqs.padding, seqs.end, seqs._steps]


def batch(pool, prompt=(5, 6, 7), pad=1, max_new_tokens=4, capacity=12, rows=2):
    ids = torch.tensor([list(prompt)] * rows)
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    return SequenceBatch(ids, mask, max_new_tokens, capacity, [2], pad_token_id=0, pool=pool)


def test_the_next_batch_of_a_shape_reuses_the_buffers_filled_afresh():
    pool = SequencePool()
    first = batch(pool)
    pointers = [t.data_ptr() for t in buffers(first)]
    first.append(torch.tensor([[3, 2], [4, 4]]), torch.tensor([2, 2]))  # what a generation leaves behind
    first.finished.fill_(True)
    del first
    assert len(pool) == 1
    again = batch(pool, prompt=(8, 9, 10), pad=2, max_new_tokens=6)
    assert [t.data_ptr() for t in buffers(again)] == pointers and pool.reused == 1
    fresh = batch(None, prompt=(8, 9, 10), pad=2, max_new_tokens=6)
    for got, want in zip(buffers(again), buffers(fresh)):
        assert torch.equal(got, want)
    assert again.host_lengths == [3, 3] and not again.all_finished()


def test_other_shapes_and_live_batches_get_their_own_buffers():
    pool = SequencePool()
    live = batch(pool)
    other = batch(pool)
    assert live.tokens.data_ptr() != other.tokens.data_ptr()
    pointer = live.tokens.data_ptr()
    del live
    assert batch(pool, rows=3).tokens.data_ptr() != pointer  # another batch size
    assert batch(pool, capacity=16).tokens.data_ptr() != pointer  # another capacity
    assert batch(pool).tokens.data_ptr() == pointer


def test_without_a_pool_nothing_is_kept_and_the_key_names_device_and_stream():
    pool = SequencePool()
    seqs = batch(None)
    del seqs
    assert len(pool) == 0
    assert SequencePool.key(2, 12, "cpu") == ("cpu", 2, 12, None, False)
    with torch.inference_mode():
        assert SequencePool.key(2, 12, torch.device("cpu"))[-1] is True
