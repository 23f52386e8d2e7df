import functools
import logging

import pytest
import torch

import saguaro
from tests.models import ARCHITECTURES, tiny_target, truncated_draft


# Tiny models gain nothing from intra-op threads, and on a loaded 2-core machine they lose a lot.
torch.set_num_threads(1)


@functools.lru_cache(maxsize=None)
def tiny_pair(arch: str, k: int = 4, backend: str = "eager"):
    """``(target, draft, program)`` for one architecture; captured once per test session."""
    target = tiny_target(arch)
    draft = truncated_draft(target)
    return target, draft, saguaro.compile(target, draft, k=k, mode="sd", backend=backend, sd_when_faster=False)


@pytest.fixture(params=sorted(ARCHITECTURES))
def arch_pair(request):
    return tiny_pair(request.param)


@pytest.fixture(autouse=True)
def _quiet_transformers():
    logging.getLogger("transformers").setLevel(logging.ERROR)
