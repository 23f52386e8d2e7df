"""On a GPU: real CUDA graphs over a tiny pair's fixed-shape stages (eager and Inductor) give exactly the
ungraphed program's tokens, greedy and sampled, generation after generation, with every capture
succeeding, every first replay equal to the ungraphed call and later generations replaying; AR's round
too, as ``saguaro.compile`` graphs it by default. Skipped without CUDA (the CPU tests run the same logic
over a fake ``torch.cuda``: test_cuda_graphs.py, test_cuda_graph_check.py, test_cuda_graph_generation.py)."""

import functools

import pytest
import torch

import saguaro
from saguaro.core.stages import TARGET_ROUND, TARGET_VERIFY
from saguaro.lower.cuda_graphs import GraphedStage
from saguaro.runtime.decode.sd_graph import ROUND_NAME
from tests.lower.graphed_program import counts, graphed
from tests.models import prompts, tiny_target, truncated_draft

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")

OPTIONS = dict(
    k=3, fan_out="geometric", fallback="neural", lane="thread", sd_when_faster=False, cuda_graphs=False
)  # the reference is ungraphed; the graphed program is graphed by hand


@functools.cache
def pair():
    target = tiny_target("llama", seed=5).to("cuda")
    return target, truncated_draft(target).to("cuda")


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("mode", ["sd", "ssd"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cuda_graphs_give_the_ungraphed_tokens(backend, mode, temperature):
    target, draft = pair()
    ids, mask = (t.to("cuda") for t in prompts(2, 7, seed=3, pad_rows={1: 2}))
    kwargs = dict(attention_mask=mask, max_new_tokens=14, temperature=temperature, eos_token_id=None, seed=0)
    plain = saguaro.compile(target, draft, mode=mode, backend=backend, **OPTIONS)
    want = plain.generate(ids, **kwargs).sequences
    program = saguaro.compile(target, draft, mode=mode, backend=backend, **OPTIONS)
    made = graphed(program, "cuda")
    for _ in range(3):
        assert torch.equal(program.generate(ids, **kwargs).sequences, want)
    total = counts(made)
    assert total["failed"] == 0, {name: s.counts for name, s in made["stages"].items()}
    assert total["captures"] > 0 and total["replays"] > total["captures"] and total["passed"] == 0
    assert total["mismatches"] == 0 and total["checks"] == total["captures"]
    verify = made["stages"][TARGET_VERIFY.for_temperature(temperature).qualified]
    if mode == "sd" and temperature == 0:  # the draft steps and the verify: one graph of the round
        assert made["stages"][f"{ROUND_NAME} k=3"].counts["captures"] == 1 and verify.counts["captures"] == 0
    else:
        assert verify.counts["captures"] == 1, "the target store keeps its address: one verify graph"


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_sd_rounds_graph_as_one_replay_by_default_and_give_the_ungraphed_tokens(backend):
    target, draft = pair()
    ids, mask = (t.to("cuda") for t in prompts(2, 7, seed=3, pad_rows={1: 2}))
    kwargs = dict(attention_mask=mask, max_new_tokens=14, eos_token_id=None)
    want = (
        saguaro.compile(target, draft, mode="sd", backend=backend, **OPTIONS)
        .generate(ids, **kwargs)
        .sequences
    )
    program = saguaro.compile(
        target, draft, mode="sd", backend=backend, k=3
    )  # cuda_graphs="auto": on on CUDA
    for _ in range(3):
        out = program.generate(ids, **kwargs)
        assert torch.equal(out.sequences, want) and out.stats["graphs_off"] == {}, out.stats["plan"]
    rounds = program.target._graphed[f"{ROUND_NAME} k=3"]
    assert (
        rounds.counts["captures"] == 1 and rounds.counts["mismatches"] == 0 and rounds.counts["replays"] > 10
    )


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_ar_rounds_graph_by_default_and_give_the_ungraphed_tokens(backend):
    target, _ = pair()
    ids, mask = (t.to("cuda") for t in prompts(2, 7, seed=4, pad_rows={0: 3}))
    kwargs = dict(attention_mask=mask, max_new_tokens=14, eos_token_id=None)
    want = saguaro.compile(target, None, mode="ar", backend=backend, cuda_graphs=False).generate(
        ids, **kwargs
    )
    program = saguaro.compile(target, None, mode="ar", backend=backend)  # cuda_graphs="auto": on on CUDA
    for _ in range(3):
        out = program.generate(ids, **kwargs)
        assert torch.equal(out.sequences, want.sequences) and out.stats["graphs_off"] == {}, out.stats["plan"]
    stage = program.target.stage(TARGET_ROUND)
    rounds = stage if isinstance(stage, GraphedStage) else stage.compiled
    assert (
        rounds.counts["captures"] == 1 and rounds.counts["mismatches"] == 0 and rounds.counts["passed"] == 0
    )
    assert program.target.seq_pool.reused == 2
