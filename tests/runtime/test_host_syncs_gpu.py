"""On a GPU: the rounds' host syncs for real. ``torch.cuda.set_sync_debug_mode("error")`` is on while each
round's device work is queued (AR's launch and its late post; SD's drafting and verify, or its round stage's
call), so an operation that syncs inside them (a hidden ``.item()``, a pageable copy) raises; the
:class:`ReadCounter` (CUDA's own events and pinned buffers) counts the reads per round as on the CPU
(``test_host_syncs.py``); the tokens equal the target's own ``generate``. Skipped without CUDA."""

from contextlib import contextmanager

import pytest
import torch

import saguaro
from saguaro.core.stages import ROUND_STAGES, TARGET_ROUND
from saguaro.runtime.base.timing import LateRead
from saguaro.runtime.decode import ar, sd
from tests.models import prompts, reference_greedy, tiny_target, truncated_draft
from tests.runtime.read_counter import ReadCounter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs on CUDA need a CUDA device")


@contextmanager
def no_sync():
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def strict(fn):
    def run(*args, **kwargs):
        with no_sync():
            return fn(*args, **kwargs)

    return run


def inputs():
    ids, mask = prompts(3, 8, seed=2, pad_rows={1: 3})
    return ids.to("cuda"), mask.to("cuda")


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("round_stage", [True, False], ids=["round", "step"])
def test_ar_rounds_on_cuda_queue_without_a_sync(temperature, round_stage, monkeypatch):
    target = tiny_target("llama", logit_scale=4.0).to("cuda")
    ids, mask = inputs()
    program = saguaro.compile(target, None, mode="ar", backend="eager")
    if not round_stage:
        monkeypatch.setattr(program.target, "provides", lambda stage: stage is not TARGET_ROUND)
    call = dict(attention_mask=mask, max_new_tokens=24, eos_token_id=None, temperature=temperature, seed=0)
    program.generate(ids, **call)  # every stage built
    for maker in ("round_in_graph", "round_by_step"):
        monkeypatch.setattr(ar, maker, lambda *args, real=getattr(ar, maker): strict(real(*args)))  # noqa: B008
    monkeypatch.setattr(LateRead, "post", strict(LateRead.post))
    counter = ReadCounter().install(monkeypatch, cuda_late_reads=False, fake_events=False)
    out = program.generate(ids, **call)
    monkeypatch.undo()
    calls = counter.round
    sync = counter.per_round(calls)
    assert calls == out.stats["rounds"] == 23, counter.where()
    assert sync[:-1] == [0] * (calls - 1) and sync[-1] == 1, counter.where()  # the closing read only
    if temperature == 0:
        assert torch.equal(out.sequences, reference_greedy(target, ids, mask, 24))


@pytest.mark.parametrize(
    "temperature,round_stage",
    [(0.0, True), (0.0, False), (1.0, False)],
    ids=["greedy-round", "greedy-verify", "sampled"],
)
def test_sd_rounds_on_cuda_sync_once(temperature, round_stage, monkeypatch):
    target = tiny_target("llama", logit_scale=4.0).to("cuda")
    program = saguaro.compile(target, truncated_draft(target), mode="sd", k=3, backend="eager")
    if not round_stage:
        monkeypatch.setattr(program.target, "provides", lambda stage: stage not in ROUND_STAGES)
    ids, mask = inputs()
    call = dict(attention_mask=mask, max_new_tokens=24, eos_token_id=None, temperature=temperature, seed=0)
    program.generate(ids, **call)
    monkeypatch.setattr(sd, "draft_speculation", strict(sd.draft_speculation))
    monkeypatch.setattr(sd, "verify", strict(sd.verify))
    monkeypatch.setattr(sd, "queue_verify_round", strict(sd.queue_verify_round))  # the round stage's call
    counter = ReadCounter().install(monkeypatch, cuda_late_reads=False, fake_events=False)
    graphed_rounds = []

    def graphed_round(*args, real=sd.graphed_sd_round):
        """Greedy under CUDA graphs, the round is one replay (no stage call marks it): the replay begins it."""
        replay = real(*args)
        if replay is None:
            return None
        graphed_rounds.append(replay)

        def marked():
            counter.next_round()
            with no_sync():
                return replay()

        return marked

    monkeypatch.setattr(sd, "graphed_sd_round", graphed_round)
    out = program.generate(ids, **call)
    monkeypatch.undo()
    assert bool(graphed_rounds) == (
        temperature == 0
    )  # greedy rounds replay one graph; sampled, stage by stage
    rounds = out.stats["rounds"]
    assert counter.round == rounds and counter.per_round(rounds) == [1] * rounds, counter.where()
    if temperature == 0:
        assert torch.equal(out.sequences, reference_greedy(target, ids, mask, 24))
