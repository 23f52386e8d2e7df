import functools
import gc
import logging
import os
import shutil
import tempfile

import pytest

# torch, saguaro and the tiny models (about 9 s of imports) are imported where tests run, not here: with
# pytest-xdist the controlling process loads this file too, before it starts the workers, and runs no test
ARCH_NAMES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
)  # tests.models.ARCHITECTURES, sorted (checked by arch_pair)


@pytest.fixture(scope="session", autouse=True)
def _one_intra_op_thread():
    """Tiny models gain nothing from intra-op threads, and on a loaded 2-core machine they lose a lot."""
    import torch

    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """The heavy tests first (stable order otherwise): pytest-xdist hands tests out in this order (one at
    a time with ``--dist loadgroup``, as ``make test`` runs it), so the long ones start at once, on
    both workers, instead of leaving one worker a long tail."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)


# What stays alive for the whole session (torch, sympy, transformers and the other modules imported while collecting
# the tests: about 380,000 objects) is frozen out of the cyclic collector's reach after collection, so its full
# collections no longer walk them again and again. The thresholds stay Python's: raising them (rarer collections)
# was tried and left cyclic garbage holding a remote lane's connection and a CUDA-graph test's pool alive.
def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


def pytest_configure(config):
    """The run's captures are kept on disk in a folder of its own (``SAGUARO_CACHE_DIR``, made here in the
    controlling process, so xdist workers and the processes tests start share it; removed at the end):
    an architecture is exported once per run, never read from an earlier run or a user's cache.

    With ``--dist loadgroup`` (``make test``), the tests of one ``xdist_group`` must reach one worker:
    the artifact tests' session fixture costs a minute and a half of torch.export and AOTInductor per
    worker that builds it. pytest-xdist 3.8 groups by rewriting ``Item._nodeid``, which pytest 9.2
    ignores (its node ids come from ``Item._id``): the grouping would be lost without a word."""
    if not hasattr(config, "workerinput") and "SAGUARO_CACHE_DIR" not in os.environ:
        config._saguaro_cache_dir = os.environ["SAGUARO_CACHE_DIR"] = tempfile.mkdtemp(
            prefix="saguaro-tests-"
        )
    # torch's cache of fake-tensor dispatches (a memo: the same graphs either way) costs more than it saves
    # on the suite's one- and two-layer models: a tiny Llama's torch.export measured 1.45 s without it
    # against 2.3 s with it (interleaved; equal at 8 layers, the cache 8 % faster at 32). Set here, before xdist
    # starts its workers, so they and every process a test starts inherit it; a value the user set stays.
    os.environ.setdefault("TORCH_FAKE_TENSOR_DISPATCH_CACHE", "0")
    # no compile helper process beside a background compile (saguaro.lower.compile_helper): the suite already
    # runs a worker per core, and a helper per program would only contend with them. The helper's own tests
    # switch it on.
    os.environ.setdefault("SAGUARO_COMPILE_HELPER", "0")
    if getattr(config.option, "dist", None) != "loadgroup":
        return
    version = tuple(int(part) for part in pytest.__version__.split(".")[:2] if part.isdigit())
    if version >= (9, 1):
        raise pytest.UsageError(
            f"pytest {pytest.__version__} loses pytest-xdist's --dist loadgroup grouping (tests of one "
            "xdist_group run on several workers); install the pytest that pyproject.toml pins (<9.1)"
        )


def pytest_unconfigure(config):
    # after this hook, pytest's unraisable-exception plugin runs gc.collect() five times over a heap that
    # holds every FX graph, fake tensor and sympy expression of the session: 5-10 s per xdist worker
    # (measured). The objects alive now are taken out of the collector's reach (gc.freeze), so that sweep
    # is short; unraisable exceptions are still reported after each test, as before.
    gc.freeze()
    folder = getattr(config, "_saguaro_cache_dir", None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        del os.environ["SAGUARO_CACHE_DIR"]


@functools.cache
def tiny_pair(arch: str, k: int = 4, backend: str = "eager"):
    """``(target, draft, program)`` for one architecture; captured once per test session."""
    import saguaro
    from tests.models import tiny_target, truncated_draft

    target = tiny_target(arch)
    draft = truncated_draft(target)
    return (
        target,
        draft,
        saguaro.compile(target, draft, k=k, mode="sd", backend=backend, sd_when_faster=False),
    )


def tiny_program(arch: str, k: int = 4, **runtime):
    """``(target, draft, program)``: ``tiny_pair(arch, k)``'s program with runtime options changed
    (``Program.reconfigure``: its captured and lowered stages are shared, nothing is captured again;
    a capture costs about 3 s of torch.export per pair on a 2-core CPU)."""
    target, draft, program = tiny_pair(arch, k)
    return target, draft, program.reconfigure(**runtime)


@pytest.fixture(params=ARCH_NAMES)
def arch_pair(request):
    from tests.models import ARCHITECTURES

    assert ARCH_NAMES == tuple(sorted(ARCHITECTURES)), (
        "conftest.ARCH_NAMES must list tests.models.ARCHITECTURES"
    )
    return tiny_pair(request.param)


@pytest.fixture(autouse=True)
def _quiet_transformers():
    logging.getLogger("transformers").setLevel(logging.ERROR)


@pytest.fixture
def no_capture_cache():
    """For a test that patches what capture runs (the attention forward, a mask rule): every capture
    in it is fresh and none is kept, so no graph built under the patch reaches another test."""
    from saguaro.capture.capture_cache import CAPTURES

    entries, CAPTURES.entries = CAPTURES.entries, 0
    CAPTURES.clear()
    switch = os.environ.get("SAGUARO_CAPTURE_CACHE")
    os.environ["SAGUARO_CAPTURE_CACHE"] = "0"  # nor read from or written to disk
    yield
    CAPTURES.entries = entries
    if switch is None:
        del os.environ["SAGUARO_CAPTURE_CACHE"]
    else:
        os.environ["SAGUARO_CAPTURE_CACHE"] = switch
