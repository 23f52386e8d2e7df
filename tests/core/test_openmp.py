"""``core.openmp.release_thread_pool``: the calling thread's OpenMP workers go, so that another thread decoding
next does not share the machine's CPUs with them (each check in a fresh process: the suite's own threads vary)."""

import subprocess
import sys
import textwrap

import pytest
import torch

SCRIPT = textwrap.dedent(
    """
    import os, torch
    from saguaro.core.openmp import loaded_runtime, release_thread_pool

    def threads():
        return len(os.listdir("/proc/self/task"))

    torch.set_num_threads(2)
    x = torch.randn(512, 512)
    (x @ x).sum()  # a parallel region: this thread's pool of OpenMP workers
    before = threads()
    released = release_thread_pool()
    after = threads()
    print(loaded_runtime() is not None, released, before, after)
    """
)


def run(script: str) -> list:
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_the_calling_threads_openmp_workers_are_released():
    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("a build without OpenMP has no pool to release")
    loaded, released, before, after = run(SCRIPT)
    assert loaded == "True" and released == "True"
    assert int(after) < int(before)  # its worker threads ended
