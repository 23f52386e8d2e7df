"""Tensor parallelism (``tensor_parallel=2``) under ``torch.distributed`` on CPU: one gloo job of three
spawned ranks per test module (``tests/runtime/tp_worker.py``: ranks 0, 1 the target's shards, rank 2 the
draft), whose results the tests below check against the unsharded program.

Exactness: greedy tokens equal the unsharded program's (itself equal to ``transformers`` ``generate``).
The sharded target sums its row-parallel projections in another order than one matmul does, so its
logits differ from the unsharded ones by float32 rounding (~1e-6); the one allowed difference is a
near tie: at the first token where the two disagree, the unsharded target's two top logits lie within
:data:`NEAR_TIE` of each other and the sharded program chose the other of the two."""

import multiprocessing

import pytest
import torch
import torch.multiprocessing as mp

import saguaro
from saguaro.core.errors import CaptureError, ConfigError
from tests.conftest import tiny_pair
from tests.models import reference_greedy, tiny_target, truncated_draft
from tests.runtime import tp_worker
from tests.runtime.remote_server_util import free_port
from tests.stats_util import chi_square_pvalue

# one worker runs this file (make test: --dist loadgroup), so the 3-rank job runs once, and early
pytestmark = [pytest.mark.heavy, pytest.mark.xdist_group("tensor_parallel")]
NEAR_TIE = 1e-4  # logit margin float32 rounding of a different summation order can flip


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each of the three ranks' ``generate`` calls returned."""
    out = tmp_path_factory.mktemp("tp")
    # a fork server that imported Saguaro once forks the three ranks: not three imports on two cores
    multiprocessing.get_context("forkserver").set_forkserver_preload(["tests.runtime.tp_worker"])
    mp.start_processes(
        tp_worker.run_rank,
        args=(free_port(), str(out)),
        nprocs=tp_worker.TP + 1,
        start_method="forkserver",
        join=True,
    )
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(tp_worker.TP + 1)]


@pytest.fixture(scope="module")
def unsharded():
    """``{arch: (target, the unsharded program)}``: the session's tiny pairs (the worker's models, k=4)."""
    assert tp_worker.K == 4  # tiny_pair's k
    return {arch: tiny_pair(arch)[::2] for arch in tp_worker.ARCHS}


def first_difference(a: torch.Tensor, b: torch.Tensor):
    """``(row, column)`` of the first token where ``a`` and ``b [B, L]`` differ, or None."""
    for row in range(a.shape[0]):
        diff = (a[row] != b[row]).nonzero()
        if len(diff):
            return row, int(diff[0])
    return None


def assert_equal_or_near_tie(sharded, reference, target, mask):
    """Equal, or they part at a near tie of the unsharded target's logits (see the module docstring)."""
    where = first_difference(sharded, reference)
    if where is None:
        return
    row, col = where
    ids = reference[row : row + 1, :col]
    row_mask = torch.cat([mask[row : row + 1], torch.ones(1, col - mask.shape[1], dtype=mask.dtype)], dim=1)
    with torch.no_grad():
        logits = target(ids, attention_mask=row_mask).logits[0, -1]  # [V]
    top = logits.topk(2)
    margin = float(top.values[0] - top.values[1])
    assert margin < NEAR_TIE and int(sharded[row, col]) in top.indices.tolist(), (
        f"row {row} column {col}: sharded {int(sharded[row, col])}, unsharded {int(reference[row, col])}, "
        f"logit margin {margin:.3g} is no near tie"
    )


@pytest.mark.heavy
@pytest.mark.parametrize("arch", tp_worker.ARCHS)
@pytest.mark.parametrize("mode", tp_worker.MODES)
def test_greedy_tokens_equal_the_unsharded_programs(ranks, unsharded, arch, mode):
    target, program = unsharded[arch]
    ids, mask = tp_worker.greedy_prompt()
    # greedy tokens are the same in every mode: the unsharded SD program's stand for all three
    expected = program.generate(ids, attention_mask=mask, max_new_tokens=tp_worker.NEW).sequences
    assert torch.equal(expected, reference_greedy(target, ids, mask, tp_worker.NEW))
    results = [rank[(arch, mode)] for rank in ranks]
    for rank, result in enumerate(results):  # every rank returns rank 0's tokens, the draft rank too
        assert torch.equal(result["sequences"], results[0]["sequences"]), f"rank {rank}"
    assert [r["stats"]["rank"] for r in results] == [0, 1, 2]
    assert_equal_or_near_tie(results[0]["sequences"], expected, target, mask)
    if mode != "ar":
        assert results[0]["stats"]["mean_accepted_len"] > 1.0
    if mode == "ssd":  # the draft rank served the lane: SSD's own rounds ran, on the rank lane
        assert results[0]["stats"]["lane"] == "rank" and not results[0]["stats"]["planned_sd"]
        assert results[0]["stats"]["lane_failures"] == 0 and results[2]["stats"]["requests"] > 0


def exact_joint(target, prefix: int) -> torch.Tensor:
    """``P(t_{prefix+1}, t_{prefix+2})`` at temperature 1, summing over the first ``prefix`` tokens: ``[V, V]``."""
    V, prompt = tp_worker.SAMPLED_VOCAB, tp_worker.SAMPLED_PROMPT
    T = prompt.shape[1]
    grid = torch.cartesian_prod(*[torch.arange(V)] * (prefix + 1)).reshape(-1, prefix + 1)  # [V^(p+1), p+1]
    with torch.no_grad():
        logp = torch.log_softmax(target(torch.cat([prompt.expand(grid.shape[0], T), grid], 1)).logits, -1)
    log_joint = logp[:, T + prefix]  # [V^(p+1), V]: the last token's distribution
    for i in range(prefix + 1):
        log_joint = log_joint + logp[:, T - 1 + i].gather(1, grid[:, i : i + 1])
    return log_joint.exp().reshape(-1, V, V).sum(0)  # [V, V]


@pytest.mark.heavy
@pytest.mark.parametrize("arch", tp_worker.ARCHS)
def test_inspect_shows_the_collectives_on_every_target_rank(ranks, arch):
    """``saguaro inspect graph target.verify_greedy`` of a target rank's program: one all-reduce per
    row-parallel projection (o and down: two per layer), named in the graph's text."""
    for rank in range(tp_worker.TP):
        seen = ranks[rank][(arch, "inspect")]
        assert seen["all_reduce_nodes"] == 2 * seen["layers"], (rank, seen["all_reduce_nodes"])
        assert seen["text"].count("all_reduce") >= 2 * seen["layers"], seen["text"][:2000]
    assert (arch, "inspect") not in ranks[tp_worker.TP]  # the draft rank holds no target shard


def test_sampled_ssd_keeps_the_targets_distribution_on_every_rank(ranks):
    results = [rank["sampled_ssd"] for rank in ranks]
    sequences = [r["sequences"] for r in results]
    assert all(torch.equal(s, sequences[0]) for s in sequences)  # one seed, the same draws on every rank
    for stats in results[0]["stats"]:  # each call's rounds ran on the rank lane, served by cache hits
        assert stats["lane"] == "rank" and stats["plan"].endswith("rank lane"), stats["plan"]
        assert stats["cache_hit_rate"] > 0.99
    assert (
        len({tuple(s[:, -4:].sum(0).tolist()) for s in sequences[0].split(tp_worker.SAMPLES)}) == 3
    )  # 3 seeds
    V = tp_worker.SAMPLED_VOCAB
    a, b = sequences[0][:, -2], sequences[0][:, -1]  # tokens 3 and 4: rounds served by cache hits
    counts = torch.bincount(a * V + b, minlength=V * V)
    assert chi_square_pvalue(counts, exact_joint(tp_worker.sampled_target(), prefix=2)) > 1e-3


def test_indivisible_heads_and_a_missing_job_are_refused_before_any_rank_joins():
    target = tiny_target("llama")  # 4 query heads, 2 KV heads
    with pytest.raises(
        CaptureError, match=r"num_attention_heads=4 and num_key_value_heads=2 do not divide by 3"
    ):
        saguaro.compile(target, truncated_draft(target), backend="eager", tensor_parallel=3)
    with pytest.raises(
        ConfigError,
        match=r"tensor_parallel=2 needs torch.distributed with 3 ranks: launch with "
        r"torchrun --nproc-per-node 3",
    ):
        saguaro.compile(target, truncated_draft(target), backend="eager", tensor_parallel=2)
    with pytest.raises(ConfigError, match=r"tensor_parallel=0 is not allowed"):
        saguaro.compile(target, truncated_draft(target), tensor_parallel=0)
