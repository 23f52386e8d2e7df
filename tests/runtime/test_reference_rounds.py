"""The reference rounds (``runtime/decode/reference.py``) and the fast paths give the same tokens and leave
the same KV stores: SD's fused verify-and-commit stage, chained drafting (one call or a catch-up first), graph
replay (over tests/lower/fake_cuda.py), sampled SD, and SSD's draft lane, greedy and sampled. Greedy tokens
are the target's own ``generate``'s."""

import functools

import pytest
import torch

import saguaro
from saguaro.core.stages import DRAFT_CHAIN, ROUND_STAGES
from saguaro.runtime.decode import DECODERS
from saguaro.runtime.decode.reference import reference_decoders
from saguaro.runtime.draft import decode
from tests.lower.fake_cuda import FakeCuda, Kernelized
from tests.lower.graphed_program import counts, graphed
from tests.models import prompts, reference_greedy, tiny_target, truncated_draft

K, NEW = 3, 20
OPTIONS = dict(k=K, backend="eager", sd_when_faster=False)
SSD = dict(mode="ssd", lane="thread", fan_out="geometric")


@functools.cache
def pair():
    target = tiny_target("llama", seed=5)
    return target, truncated_draft(target, noise=0.05)  # rounds that accept all k and rounds that reject


@functools.cache
def program():
    return saguaro.compile(*pair(), mode="sd", **OPTIONS)


def call(batch: int = 2) -> dict:
    ids, mask = prompts(batch, 7, seed=3, pad_rows={1: 2})
    return dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=None)


def kv(store) -> dict:
    """A store's state: the slots' positions and branches ``[B, S]``, and each layer's K and V at the valid
    slots (what a later attention reads; an emptied slot's stale values are never read)."""
    valid = store.slot_pos >= 0  # [B, S]
    caches = [c.transpose(1, 2)[valid].clone() for c in (*store.k_caches, *store.v_caches)]  # [N, Hkv, D]
    return {"slot_pos": store.slot_pos.clone(), "slot_branch": store.slot_branch.clone(), "caches": caches}


def generation(prog, decoders: dict, **kwargs):
    """``(out, {"target": kv, "draft": kv})`` of one ``generate`` by ``decoders``; the draft's store is the
    state's (SD, reference SSD) or the thread lane's server's (SSD)."""
    seen = {}

    def capturing(decoder):
        def run(target, draft, state, plan, first):
            decoder(target, draft, state, plan, first)
            store = state.draft_store if state.draft_store is not None else plan.lane.lane.server.store
            seen.update(target=kv(state.target_store), draft=kv(store))

        return run

    prog.decoders = {mode: capturing(decoder) for mode, decoder in decoders.items()}
    try:
        out = prog.generate(**kwargs)
    finally:
        del prog.decoders  # the class's DECODERS again
    return out, seen


def assert_same(fast, reference, atol: float = 0.0):
    """Tokens and slots equal; caches equal, or within ``atol`` (KV written by calls of other widths)."""
    (out, stores), (want, want_stores) = fast, reference
    assert torch.equal(out.sequences, want.sequences)
    for model in ("target", "draft"):
        got, expected = stores[model], want_stores[model]
        assert torch.equal(got["slot_pos"], expected["slot_pos"]), model
        assert torch.equal(got["slot_branch"], expected["slot_branch"]), model
        for a, b in zip(got["caches"], expected["caches"]):
            torch.testing.assert_close(a, b, rtol=0.0, atol=atol, msg=model)


def by_reference(prog, **kwargs):
    out, stores = generation(prog, reference_decoders(prog.config), **kwargs)
    return out, stores


def test_the_reference_sd_round_equals_transformers_and_visits_both_draft_feeds():
    kwargs = call()
    out, _ = by_reference(program(), **kwargs)
    target, _ = pair()
    assert torch.equal(
        out.sequences, reference_greedy(target, kwargs["input_ids"], kwargs["attention_mask"], NEW)
    )
    lengths = set(out.counters.accepted_lengths)
    assert K + 1 in lengths and lengths - {K + 1}, f"every round accepted alike: {lengths}"


@pytest.mark.parametrize(
    "path", ["fused verify, chained drafting", "verify stage", "draft steps", "chained with a catch-up call"]
)
def test_fast_sd_paths_equal_the_reference(path, monkeypatch):
    prog, kwargs = program(), call()
    reference = by_reference(prog, **kwargs)
    if path == "verify stage":  # a target builder without the fused stage: verify, then the host's commit
        monkeypatch.setattr(prog.target, "provides", lambda stage: stage not in ROUND_STAGES)
    elif path == "draft steps":  # a draft builder without the chained step
        monkeypatch.setattr(prog.draft, "provides", lambda stage: stage is not DRAFT_CHAIN)
    elif path == "chained with a catch-up call":  # as where the draft's linears are Inductor's reductions
        monkeypatch.setattr(decode, "feeds_together", lambda draft, stage: False)
    # a catch-up call writes the KV of the token before r alone, the reference in a two-token call: BLAS
    # rounds a one-row product and a two-row one apart, by an ulp (the same tokens: only the KV is read)
    atol = 1e-6 if path == "chained with a catch-up call" else 0.0
    assert_same(generation(prog, DECODERS, **kwargs), reference, atol)


def test_the_graph_replayed_sd_round_equals_the_reference(monkeypatch):
    reference = by_reference(program(), **call())
    cuda = FakeCuda().install(monkeypatch)
    replayed = saguaro.compile(*pair(), mode="sd", **OPTIONS)
    made = graphed(replayed, "cpu", lambda fn, stage: Kernelized(fn, cuda))
    # the graph's first draft call always feeds two tokens (its shapes are fixed): it rewrites the KV of the
    # token before r, by an ulp apart from the one the reference's own one-token call wrote
    for _ in range(2):  # the first generation captures the round's graph, the second replays it throughout
        assert_same(generation(replayed, DECODERS, **call()), reference, atol=1e-6)
    assert counts(made)["replays"] > 0


def test_sampled_sd_equals_the_reference_for_a_seed():
    """The same draws in the same order: a uniform per row and draft call, then the verify's uniforms."""
    prog, kwargs = program(), call() | dict(temperature=0.9)
    for seed in (0, 1):
        assert_same(generation(prog, DECODERS, seed=seed, **kwargs), by_reference(prog, seed=seed, **kwargs))


@pytest.mark.parametrize(
    "temperature, fallback",
    [(0.0, "neural"), (0.0, "fast"), (0.9, "neural")],
    ids=["greedy", "fast", "sampled"],
)
def test_ssd_on_the_draft_lane_equals_the_reference(temperature, fallback):
    """The lane builds beside the verify and matches on the host; the reference does each in turn. Sampled,
    the target's and the draft's generators each draw as the lane's rounds do (the draft's: the tree's
    uniforms, then the neural fallback's)."""
    prog, (target, _) = program().reconfigure(fallback=fallback, **SSD), pair()
    kwargs = call(3) | dict(temperature=temperature, seed=4)
    ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
    if temperature == 0:  # row 0 ends early by EOS: the rounds after it look up the other rows only
        kwargs["eos_token_id"] = int(reference_greedy(target, ids, mask, NEW)[0, 7 + 4])
    try:
        fast = generation(prog, DECODERS, **kwargs)
        reference = by_reference(prog, **kwargs)
        assert fast[0].stats["ran_as"] == "ssd" and fast[0].stats["cache_hit_rate"] > 0
        assert fast[0].stats["fallbacks"][fallback] > 0
        assert_same(fast, reference)
        assert fast[0].stats["fallbacks"] == reference[0].stats["fallbacks"]
        assert fast[0].stats["cache_hit_rate"] == reference[0].stats["cache_hit_rate"]
        if temperature == 0:
            want = reference_greedy(target, ids, mask, NEW, eos_token_id=kwargs["eos_token_id"])
            assert torch.equal(reference[0].sequences, want)
    finally:
        prog.close()


def test_the_reference_ssd_round_asks_for_a_fixed_fan_out_and_fallback():
    prog = program().reconfigure(mode="ssd", lane="thread", fan_out="auto", fallback="neural")
    try:
        with pytest.raises(saguaro.ConfigError, match="fan_out"):
            by_reference(prog, **call())
    finally:
        prog.close()
