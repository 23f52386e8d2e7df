"""Device→host reads per round, counted on the CPU for every mode (``read_counter.py`` says how: the
calls that sync on CUDA, a ``Stopwatch``'s events faked so a wait for one counts, and the late reads of
``LateRead`` told apart from syncs).

- AR (greedy by its round stage or by the step, and sampled): no sync in a round. The rows still active
  are read a round late (one ``late`` read a round, after the first), and the one sync is the closing
  read after the last round (the result's host view).
- SD (greedy by its round stage or by the verify, and sampled): at most one sync a round, the outcome read
  (packed by the round stage, or by ``commit``); the verify's timing is read after it, never waited for.
- SSD: at most one read per lane a round: the outcome on the target lane (``commit``), the build's
  candidate table on the draft lane (``SpeculationServer._read_build``, off the critical path).
  Everything else a round decides is host data.
"""

from __future__ import annotations

import pytest

from saguaro.core.stages import ROUND_STAGES, TARGET_ROUND, TARGET_VERIFY_ROUND
from saguaro.runtime.decode import ssd
from tests.conftest import tiny_program
from tests.models import prompts
from tests.runtime.read_counter import ReadCounter

MAX_READS_PER_ROUND = 2  # SSD: the outcome (target lane) and the candidate table (draft lane)
MAX_SETUP_READS = 4  # the input checks and the prefill's read of the finished flags


def counted_generate(program, monkeypatch, **call):
    """Generate twice (the first warms every stage up, uncounted); count the second's reads."""
    ids, mask = prompts(3, 8, seed=2, pad_rows={1: 3})
    call = dict(attention_mask=mask, max_new_tokens=24, eos_token_id=None, seed=0) | call
    try:
        program.generate(ids, **call)
        counter = ReadCounter().install(monkeypatch)
        out = program.generate(ids, **call)
        monkeypatch.undo()
    finally:
        program.close()
    return out, counter


AR_CASES = {
    "greedy-round": dict(temperature=0.0),
    "greedy-step": dict(temperature=0.0, round_stage=False),
    "sampled": dict(temperature=1.0),
}


@pytest.mark.parametrize("case", sorted(AR_CASES))
def test_an_ar_round_never_syncs_and_reads_the_active_rows_a_round_late(case, monkeypatch):
    options = dict(AR_CASES[case])
    _, _, program = tiny_program("llama", mode="ar")
    if not options.pop("round_stage", True):
        monkeypatch.setattr(program.target, "provides", lambda stage: stage is not TARGET_ROUND)
    out, counter = counted_generate(program, monkeypatch, **options)
    rounds, calls = out.stats["rounds"], counter.round
    assert out.stats["mode"] == "ar" and rounds == 23  # 24 new tokens, the prefill decided the first
    assert calls == rounds  # the budget ends every row: the host sees it coming, no round past the end
    sync, late = counter.per_round(calls), counter.per_round(calls, "late")
    copies = [r for r, kind, _, what, _ in counter.reads if kind == "late" and what == "tolist"]  # rounds
    report = f"{case}: syncs per round {sync}, late reads {late}, {counter.setup()} before; where:\n{counter.where()}"
    print(report)
    assert sync[:-1] == [0] * (calls - 1), report  # no round waits for the device ...
    assert sync[-1] == 1, report  # ... but the last, whose closing read the result needs
    assert copies == list(range(2, calls + 1)), report  # each round reads the one before's pinned copy
    assert counter.setup() <= MAX_SETUP_READS, report


SD_CASES = {
    "greedy-round": dict(temperature=0.0),
    "greedy-verify": dict(temperature=0.0, round_stage=False),
    "sampled": dict(temperature=1.0),
}


@pytest.mark.parametrize("case", sorted(SD_CASES))
def test_an_sd_round_syncs_at_most_once(case, monkeypatch):
    options = dict(SD_CASES[case])
    _, _, program = tiny_program("llama", k=3, mode="sd")
    round_stage = options.pop("round_stage", True) and options["temperature"] == 0
    if not round_stage:
        monkeypatch.setattr(program.target, "provides", lambda stage: stage not in ROUND_STAGES)
    calls, runner = [], program.target

    def listed_run(stage, *args, **kwargs):  # through the class's run, which the read counter patches
        calls.append(stage)
        return type(runner).run(runner, stage, *args, **kwargs)

    monkeypatch.setattr(runner, "run", listed_run)
    out, counter = counted_generate(program, monkeypatch, **options)
    rounds = out.stats["rounds"]
    assert out.stats["mode"] == "sd" and rounds >= 4 and counter.round == rounds
    assert (
        TARGET_VERIFY_ROUND in calls
    ) == round_stage  # the greedy verify and commit in one stage call, or not
    sync = counter.per_round(rounds)
    report = f"sd {case}: syncs per round {sync}, {counter.setup()} before; where:\n{counter.where()}"
    print(report)
    assert max(sync) <= 1 and sum(sync) == rounds, report  # commit's read, each round
    assert not any(counter.per_round(rounds, "late")) and out.stats["verify_s"] > 0, report
    assert counter.setup() <= MAX_SETUP_READS, report


SSD_CASES = {
    "greedy-neural": dict(temperature=0.0, fallback="neural"),
    "greedy-fast": dict(temperature=0.0, fallback="fast"),
    "sampled-neural": dict(temperature=1.0, fallback="neural"),
}


@pytest.mark.parametrize("case", sorted(SSD_CASES))
def test_an_ssd_round_reads_the_device_once_per_lane(case, monkeypatch):
    options = SSD_CASES[case]
    _, _, program = tiny_program(
        "llama", k=3, mode="ssd", lane="thread", fan_out="geometric", fallback=options["fallback"]
    )
    ids, mask = prompts(3, 8, seed=2, pad_rows={1: 3})
    call = dict(
        attention_mask=mask, max_new_tokens=24, eos_token_id=None, temperature=options["temperature"], seed=0
    )
    try:
        program.generate(ids, **call)  # the lane's warm-up and every stage's first call: not counted
        counter = ReadCounter().install(monkeypatch, count_rounds=False)
        real_round = ssd.ssd_round

        def counted_round(*args):
            counter.next_round()
            return real_round(*args)

        monkeypatch.setattr(ssd, "ssd_round", counted_round)
        out = program.generate(ids, **call)
        monkeypatch.undo()
    finally:
        program.close()
    stats = out.stats
    assert stats["mode"] == "ssd" and stats["rounds"] >= 4
    # both paths of a round ran: hits, and misses served by the fallback
    assert sum(stats["hits_by_position"].values()) > 0 and stats["fallbacks"][options["fallback"]] > 0
    per_round = counter.per_round(stats["rounds"])
    on_target = counter.per_round(stats["rounds"], lane="target")
    report = (
        f"{case}: reads per round {per_round} (max {max(per_round)}), on the target lane {on_target}, "
        f"{counter.setup()} before the first round; where:\n{counter.where()}"
    )
    print(report)
    assert max(per_round) <= MAX_READS_PER_ROUND, report
    assert max(on_target) <= 1, report  # the outcome; the verify's timing is read after it, never waited for
    assert counter.setup() <= MAX_SETUP_READS, report
