"""Weights on huge pages: the copy holds the same values, dtype and shape on a 2 MiB-aligned mapping that lives as
long as the tensor; small, non-CPU or unsupported cases come back unchanged; the packed linears' panels and the
loaded artifact's tensors are placed; the packed kernel reads a placed tensor as it reads any other."""

import gc
import weakref

import pytest
import torch

from saguaro.tensor_math import huge_pages as hp
from saguaro.tensor_math import packed_linear as pl

needs_thp = pytest.mark.skipif(
    not hp.available(), reason="no transparent huge pages here (mode never or not Linux)"
)


def test_mode_reads_the_bracketed_word(tmp_path, monkeypatch):
    file = tmp_path / "enabled"
    file.write_text("always [madvise] never\n")
    monkeypatch.setattr(hp, "MODE_FILE", file)
    hp.mode.cache_clear()
    try:
        assert hp.mode() == "madvise"
        file.write_text("always madvise [never]\n")
        hp.mode.cache_clear()
        assert hp.mode() == "never" and not hp.available()
        monkeypatch.setattr(hp, "MODE_FILE", tmp_path / "missing")
        hp.mode.cache_clear()
        assert hp.mode() is None and not hp.available()
    finally:
        hp.mode.cache_clear()


def test_small_tensors_and_unsupported_platforms_come_back_unchanged(monkeypatch):
    small = torch.randn(64, 64)  # 16 KiB
    assert hp.on_huge_pages(small) is small
    big = torch.randn(1024, 1024)  # 4 MiB
    monkeypatch.setattr(hp, "available", lambda: False)
    assert hp.on_huge_pages(big) is big
    assert hp.empty((1024, 1024), torch.float32).shape == (1024, 1024)


@needs_thp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.uint8])
def test_the_copy_holds_the_values_on_an_aligned_mapping(dtype):
    source = (torch.randn(3, 700, 1024) * 50).to(dtype)  # not a multiple of 2 MiB
    placed = hp.on_huge_pages(source)
    assert placed is not source and placed.dtype == dtype and placed.shape == source.shape
    assert placed.is_contiguous() and torch.equal(placed, source)
    assert placed.data_ptr() % hp.HUGE_PAGE == 0
    placed += 1  # writable, and not the source's memory
    assert not torch.equal(placed, source)


@needs_thp
def test_the_mapping_lives_while_a_view_of_it_does():
    placed = hp.on_huge_pages(torch.arange(2**20, dtype=torch.float32))  # 4 MiB
    view = placed[10:20]
    probe = weakref.ref(placed)
    del placed
    gc.collect()
    assert probe() is None  # the first tensor is gone, its memory is not
    assert torch.equal(view, torch.arange(10, 20, dtype=torch.float32))


@needs_thp
def test_huge_page_share_reads_smaps():
    if hp.mode() == "madvise":  # torch's allocator does not advise: its memory is on small pages
        assert hp.huge_page_share(torch.ones(4 * 2**20, dtype=torch.uint8)) == 0.0
    placed = hp.on_huge_pages(torch.ones(4 * 2**20, dtype=torch.uint8))
    share = hp.huge_page_share(placed)
    if share == 0.0:
        pytest.skip("the kernel found no free huge page for the mapping (fragmented memory)")
    assert 0.5 <= share <= 1.0  # two whole 2 MiB pages


@needs_thp
@pytest.mark.skipif(not pl.available(), reason="the packed kernel could not be built here")
def test_packed_panels_are_placed_and_read_as_any_tensor():
    from saguaro.passes.pack_linears import panels

    weight = torch.randn(4096, 512).bfloat16()  # 4 MiB of panels
    held = panels(weight, True)
    assert held.data_ptr() % hp.HUGE_PAGE == 0
    x = torch.randn(3, 512)
    assert torch.equal(pl.packed_linear(x, held, 4096), pl.packed_linear(x, pl.pack(weight), 4096))


@needs_thp
def test_loaded_tensors_are_placed_and_aliases_share_one_copy():
    from saguaro.artifact.load import placed

    big, small = torch.randn(1024, 1024), torch.randn(4, 4)
    loaded = placed({"big": big, "alias": big, "small": small})
    assert loaded["big"].data_ptr() % hp.HUGE_PAGE == 0 and loaded["alias"] is loaded["big"]
    assert torch.equal(loaded["big"], big) and loaded["small"] is small
