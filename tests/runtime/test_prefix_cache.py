"""Prefix caching (``Program.cache_prefixes``, ``runtime/base/prefix_cache.py``): a prompt that shares a prefix
with an earlier one reuses that prefix's KV, the target's and the local draft's, and its greedy output stays what
``generate`` gives it without the cache, in AR, SD and SSD and in a batch session; the reused slots hold exactly
what a whole prefill writes."""

import pytest
import torch

import saguaro
from saguaro.runtime.base.kv_store import KVStore
from saguaro.runtime.base.prefix_cache import PrefixCache
from saguaro.runtime.batching import BatchSession
from tests.conftest import tiny_program
from tests.models import prompts, tiny_target, truncated_draft
from tests.runtime.test_batch_session import drive, solo

SHARED = 30  # the system prompt's tokens


def related_prompts():
    """Three prompts over one shared prefix of :data:`SHARED` tokens, of different lengths (and padding)."""
    ids, _ = prompts(3, 48, seed=7)
    system = ids[0, :SHARED].tolist()
    return [system + ids[1, :9].tolist(), system + ids[2, :17].tolist(), system + ids[1, 30:34].tolist()]


def greedy(program, prompt, mode):
    out = program.generate(torch.tensor([prompt]), max_new_tokens=16, temperature=0.0, mode=mode)
    return out.sequences[0].tolist(), out.stats


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_a_shared_prefix_is_reused_and_greedy_outputs_stay_those_without_the_cache(mode):
    if mode == "ssd":
        target = tiny_target("llama")
        program = saguaro.compile(
            target,
            truncated_draft(target),
            k=3,
            mode="ssd",
            lane="thread",
            backend="eager",
            sd_when_faster=False,
        )
    else:
        _, _, program = tiny_program("llama", mode=mode)
    want = [greedy(program, p, mode)[0] for p in related_prompts()]
    program.cache_prefixes(4096)
    try:
        got = [greedy(program, p, mode) for p in related_prompts()]
        again = greedy(program, related_prompts()[1], mode)
    finally:
        program.cache_prefixes(None)
    assert [tokens for tokens, _ in got] == want
    assert [stats["prefix_cached_tokens"] for _, stats in got] == [0, SHARED, SHARED]
    assert again[0] == want[1] and again[1]["prefix_cached_tokens"] == len(related_prompts()[1]) - 2


def test_a_batch_session_reuses_the_prefix_for_each_joining_row():
    _, _, program = tiny_program("llama", mode="sd")
    requests = [(at, p, 16, None) for at, p in zip((0, 0, 2), related_prompts())]
    want = [solo(program, p, budget) for _, p, budget, _ in requests]
    program.cache_prefixes(4096)
    try:
        got, sizes = drive(BatchSession(program, 0.0, "sd"), requests)
        cache = program.prefix_cache
        assert (cache.lookups, cache.hits, cache.reused_tokens) == (3, 2, 2 * SHARED)
    finally:
        program.cache_prefixes(None)
    assert [got[i] for i in range(3)] == want and max(sizes) >= 2


def test_reused_slots_hold_exactly_what_a_whole_prefill_writes():
    _, _, program = tiny_program("llama", mode="ar")
    spec = program.target.spec
    prompt = related_prompts()[0]
    whole = program.target.new_store(1, 64)
    cache = PrefixCache(1000)
    cache.keep(prompt, 0, *fill(program, whole, prompt))
    fresh = program.target.new_store(1, 64)
    reused = cache.restore(prompt[:SHARED] + [5, 6, 7], 3, fresh, None)
    assert reused == SHARED
    for mine, theirs in zip((*fresh.k_caches, *fresh.v_caches), (*whole.k_caches, *whole.v_caches)):
        assert torch.equal(mine[0, :, 3 : 3 + SHARED], theirs[0, :, :SHARED])
    assert fresh.slot_pos[0, 3 : 3 + SHARED].tolist() == list(range(SHARED))
    assert (fresh.slot_pos[0, :3] == -1).all() and (fresh.slot_pos[0, 3 + SHARED :] == -1).all()
    assert isinstance(fresh, KVStore) and spec.vocab_size > 0


def fill(program, store, prompt):
    """Prefill ``prompt`` into ``store`` at columns ``0..n-1``: ``(store, None)`` for :meth:`PrefixCache.keep`."""
    from saguaro.core.stages import TARGET_PREFILL

    n = len(prompt)
    index = torch.arange(n)[None, :]
    with torch.inference_mode():
        program.target.run(TARGET_PREFILL, store, torch.tensor([prompt]), index, index)
    return store, None


def test_entries_go_least_recently_used_first_and_bad_sizes_are_refused():
    _, _, program = tiny_program("llama", mode="ar")
    cache = PrefixCache(70)
    a, b, c = ([t] * 30 for t in (5, 6, 7))
    for tokens in (a, b):
        cache.keep(tokens, 0, *fill(program, program.target.new_store(1, 64), tokens))
    assert cache.restore(a + [9, 9], 0, program.target.new_store(1, 64), None) == 30  # a: used last
    cache.keep(c, 0, *fill(program, program.target.new_store(1, 64), c))
    assert [e[0] for e in cache.entries] == [5, 7] and cache.held_tokens == 60  # b went
    held = cache.entries[tuple(a)]
    cache.keep(a, 0, *fill(program, program.target.new_store(1, 64), a))  # the same tokens again
    assert cache.entries[tuple(a)] is held and [e[0] for e in cache.entries] == [
        7,
        5,
    ]  # not copied, most recent
    assert cache.restore([6] * 10, 0, program.target.new_store(1, 64), None) == 0
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="max_tokens"):
            PrefixCache(bad)
    with pytest.raises(ValueError, match="max_tokens"):
        program.cache_prefixes(-4)


def test_serve_takes_the_prefix_cache_size_and_refuses_a_negative_one(capsys):
    from saguaro.cli.main import build_parser, subcommands

    parser = build_parser(subcommands())
    assert parser.parse_args(["serve"]).prefix_cache_tokens == 0  # off unless asked
    assert parser.parse_args(["serve", "--prefix-cache-tokens", "8192"]).prefix_cache_tokens == 8192
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--prefix-cache-tokens", "-1"])
    assert "prefix_cache_tokens=-1 is not allowed" in capsys.readouterr().err


def test_served_requests_report_their_cached_prompt_tokens_and_keep_their_answers():
    """``saguaro serve --prefix-cache-tokens``: a request whose prompt starts with an earlier one's reuses its KV,
    says so in ``usage.prompt_tokens_details.cached_tokens`` (as OpenAI does), and answers what it answers without
    the cache; batched (greedy) and alone (a grammar) alike."""
    import httpx

    from tests.serve.server_util import start

    _, _, program = tiny_program("llama", mode="sd")
    system = related_prompts()[0][:SHARED]
    bodies = [
        {"prompt": system + [40 + i] * (3 + i), "max_tokens": 8, "temperature": 0} for i in range(3)
    ] + [
        {
            "prompt": system + [90, 91, 92],
            "max_tokens": 8,
            "temperature": 0,
            "response_format": {"type": "json_object"},
        }
    ]
    running = start(program)
    try:
        want = [httpx.post(running.url + "/completions", json=b, timeout=120).json() for b in bodies]
        program.cache_prefixes(4096)
        got = [httpx.post(running.url + "/completions", json=b, timeout=120).json() for b in bodies]
    finally:
        program.cache_prefixes(None)
        running.stop()
    assert [g["choices"][0]["text"] for g in got] == [w["choices"][0]["text"] for w in want]
    assert all("prompt_tokens_details" not in w["usage"] for w in want)
    cached = [g["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) for g in got]
    assert cached == [0, SHARED, SHARED, SHARED], cached
