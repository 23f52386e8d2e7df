"""Shared helpers of the pass tests: a captured tiny model, a store, and calls of stage graphs."""

from __future__ import annotations

import functools

import torch

from saguaro.capture import capture
from saguaro.passes import run_pipeline
from saguaro.runtime.base.kv_store import KVStore
from tests.models import tiny_target


@functools.cache
def base_graph():
    model = tiny_target("llama")
    captured = capture(model)
    captured.graph_module = run_pipeline(captured.graph_module)
    return model, captured


def count(gm, target):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


def prefilled_store(spec, prompt):
    """A store holding ``prompt [B, T]`` in slots 0..T-1, written through the captured graph."""
    _, captured = base_graph()
    B, T = prompt.shape
    store = KVStore(spec, B, 48)
    call(captured.graph_module, store, prompt, torch.arange(T).expand(B, T).contiguous())
    return store


def call(gm, store, ids, index, *extra, branch=None, limit=None, slots=None):
    """Run ``gm`` on ``ids`` at positions ``index``, written to ``slots`` (default: the positions)."""
    branch = torch.zeros_like(index) if branch is None else branch
    limit = index if limit is None else limit
    slots = index if slots is None else slots
    store.claim(slots, index, branch)
    return gm(
        ids,
        index,
        slots,
        branch,
        limit,
        store.slot_pos,
        store.slot_branch,
        *store.k_caches,
        *store.v_caches,
        *extra,
    )
