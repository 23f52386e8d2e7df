"""The OpenMP threads a thread keeps after its parallel work, released before another thread takes that work over.

Each thread that runs a parallel region (an Inductor kernel, a matmul) keeps a pool of OpenMP worker threads. Once
the pools of all threads hold more threads than the machine has CPUs, GNU OpenMP (PyTorch's) stops spinning
between regions: every region then wakes its workers from sleep, and a round of many small kernels pays a wake-up
at each. ``saguaro serve`` loads, compiles and warms up in the main thread and decodes in its scheduler thread;
without a release, its rounds ran at about half the speed of the same rounds in one thread. In mode ssd too: the
main thread's pool idles beside the scheduler's and the draft lane's, and released, served ssd ran at 1.4x its speed
with the pool kept; one run in six stalled for seconds, cause not found (docs/measurements/2026-12-07-openmp-pools.md).
"""

from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # OpenMP 5.0's omp_pause_soft: the runtime may keep what restarting needs
RUNTIME_NAMES = ("libgomp", "libiomp", "libomp")  # the OpenMP runtimes a PyTorch build loads


def loaded_runtime() -> str | None:
    """The path of the OpenMP runtime this process has loaded (``/proc/self/maps``), or None (none, or no maps)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = [line.split()[-1] for line in maps if "/" in line]
    except OSError:
        return None
    return next((p for p in paths if p.rsplit("/", 1)[-1].startswith(RUNTIME_NAMES)), None)


@functools.cache
def _pause_call():
    """The loaded runtime's ``omp_pause_resource_all`` (ctypes), or None; looked up once (torch loads the runtime
    on import, before any caller here)."""
    path = loaded_runtime()
    if path is None:
        return None
    try:
        pause = ctypes.CDLL(path).omp_pause_resource_all
    except (OSError, AttributeError):
        return None
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause


def release_thread_pool() -> bool:
    """Release the calling thread's OpenMP worker threads (``omp_pause_resource_all``); its next parallel region
    starts new ones. Call it from a thread done with parallel work before another thread does that work. Returns
    whether the runtime released them (False: no OpenMP runtime loaded, or it has no such call, or it refused,
    as it does inside a parallel region)."""
    pause = _pause_call()
    if pause is None:
        return False
    released = pause(OMP_PAUSE_SOFT) == 0
    log.debug("OpenMP worker threads of this thread %s", "released" if released else "kept")
    return released
