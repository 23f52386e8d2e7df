"""Tensors on transparent huge pages (faster to stream: docs/measurements/2026-12-06-huge-pages.md)."""

from __future__ import annotations

import functools
import math
import mmap
import sys
from pathlib import Path

import torch

HUGE_PAGE = 2 * 2**20
MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def mode() -> str | None:
    """The kernel's transparent-huge-page mode (``"always"``, ``"madvise"``, ``"never"``), else None."""
    try:
        text = MODE_FILE.read_text()
    except OSError:
        return None
    chosen = [word[1:-1] for word in text.split() if word.startswith("[") and word.endswith("]")]
    return chosen[0] if chosen else None


def available() -> bool:
    """Whether huge pages can be asked for here: Linux, ``mmap.MADV_HUGEPAGE``, mode always or madvise."""
    return (
        sys.platform.startswith("linux")
        and hasattr(mmap, "MADV_HUGEPAGE")
        and mode() in ("always", "madvise")
    )


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A new CPU tensor on a mapping advised for huge pages; ``torch.empty`` under a page or not available."""
    # torch's allocator does not ask for huge pages (unless THP_MEM_ALLOC_ENABLE=1 before its first
    # allocation); the kernel may still back the mapping with small pages: the same values, only slower
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not available():
        return torch.empty(shape, dtype=dtype, device="cpu")
    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    mapping = mmap.mmap(-1, length + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    offset = -start % HUGE_PAGE  # the first page boundary inside the mapping
    mapping.madvise(mmap.MADV_HUGEPAGE, offset, length)
    # frombuffer holds a reference to the mapping: it is unmapped when the last tensor over it is freed
    raw = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)
    return raw.view(dtype).view(shape)


def on_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``tensor`` by :func:`empty` (no grad), or ``tensor`` if it gets no huge pages."""
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or nbytes < HUGE_PAGE or not available():
        return tensor
    placed = empty(tuple(tensor.shape), tensor.dtype)
    with torch.no_grad():
        placed.copy_(tensor)
    return placed


def huge_page_share(tensor: torch.Tensor) -> float:
    """The share (0.0 .. 1.0) of ``tensor``'s bytes on huge pages now, read from /proc/self/smaps, else 0."""
    address, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0.0
    for index, line in enumerate(lines):
        head = line.split(maxsplit=1)[0]
        if "-" not in head or ":" in head:
            continue
        low, high = (int(part, 16) for part in head.split("-"))
        if low <= address < high:
            for entry in lines[index + 1 :]:
                if entry.startswith("AnonHugePages:"):
                    return min(1.0, int(entry.split()[1]) * 1024 / max(nbytes, 1))
            return 0.0
    return 0.0
