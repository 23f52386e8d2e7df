"""Weights on transparent huge pages: the memory a few-row linear streams, mapped 2 MiB at a time.

A decode step reads every weight once, front to back. On 4 KiB pages that is one page walk every 4 KiB and the
hardware prefetchers, which work within a page, restart at each page's start; on 2 MiB pages the same stream
reads 1.2-1.3x faster (measured in ``docs/measurements/2026-12-06-huge-pages.md``). Linux gives a process huge
pages where its transparent-huge-page mode is ``always``, or ``madvise`` and the process asks
(``madvise(MADV_HUGEPAGE)``), which is the common default; torch's allocator does not ask (unless the user sets
``THP_MEM_ALLOC_ENABLE=1`` before torch's first allocation).

:func:`on_huge_pages` copies a tensor onto an anonymous mapping aligned to 2 MiB and advised for huge pages, and
returns the copy (same dtype, shape and values; contiguous; the mapping lives as long as the tensor). It returns
its input unchanged where that cannot help or cannot be done: a tensor under 2 MiB or not on the CPU, a platform
without ``MADV_HUGEPAGE`` or a kernel whose mode is ``never``. The kernel may still back the mapping with small
pages (no free huge page); the values are the same either way, only the speed differs.
"""

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
    """The kernel's transparent-huge-page mode (``"always"``, ``"madvise"`` or ``"never"``), None where unknown
    (not Linux, or the file is not readable)."""
    try:
        text = MODE_FILE.read_text()
    except OSError:
        return None
    chosen = [word[1:-1] for word in text.split() if word.startswith("[") and word.endswith("]")]
    return chosen[0] if chosen else None


def available() -> bool:
    """Whether :func:`on_huge_pages` can place a tensor on huge pages here: Linux, ``MADV_HUGEPAGE`` known to
    Python's ``mmap`` and the mode ``always`` or ``madvise``."""
    return sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE") and mode() in ("always", "madvise")


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor of ``shape`` and ``dtype`` on a 2 MiB-aligned mapping advised for
    huge pages, or ``torch.empty`` where it is under 2 MiB or :func:`available` is False."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not available():
        return torch.empty(shape, dtype=dtype, device="cpu")
    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    mapping = mmap.mmap(-1, length + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    offset = -start % HUGE_PAGE  # the first 2 MiB boundary inside the mapping
    mapping.madvise(mmap.MADV_HUGEPAGE, offset, length)
    # frombuffer holds a reference to the mapping: it is unmapped when the last tensor over it is freed
    raw = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)
    return raw.view(dtype).view(shape)


def on_huge_pages(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values on a 2 MiB-aligned mapping advised for huge pages (a new contiguous tensor of the same
    dtype and shape, not requiring grad), or ``tensor`` itself where it is under 2 MiB, not on the CPU, or
    :func:`available` is False."""
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or nbytes < HUGE_PAGE or not available():
        return tensor
    placed = empty(tuple(tensor.shape), tensor.dtype)
    with torch.no_grad():
        placed.copy_(tensor)
    return placed


def huge_page_share(tensor: torch.Tensor) -> float:
    """The share of ``tensor``'s bytes the kernel backs with huge pages now (0.0 .. 1.0), read from
    ``/proc/self/smaps``; 0.0 where that cannot be read or the tensor is not in a mapping listed there."""
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
            for entry in lines[index + 1:]:
                if entry.startswith("AnonHugePages:"):
                    return min(1.0, int(entry.split()[1]) * 1024 / max(nbytes, 1))
            return 0.0
    return 0.0
