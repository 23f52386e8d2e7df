"""The scheduler without HTTP: requests submitted together each get, token for token, what they get alone
through ``program.generate``: AR and SD rows join and leave running batches (continuous batching), one batch
per temperature, seeded sampled rows among them; SSD's batches run back to back."""

import threading

from saguaro.serve.metrics import Metrics
from saguaro.serve.requests import Sampling
from saguaro.serve.scheduler import Job, Scheduler
from tests.conftest import tiny_program
from tests.models import prompts
from tests.serve.server_util import solo


def run_jobs(program, samplings, max_batch=8):
    metrics = Metrics()
    scheduler = Scheduler(program, metrics, max_batch=max_batch, max_queue=64)
    ended = [threading.Event() for _ in samplings]
    reasons = [None] * len(samplings)

    def deliver_to(i):
        def deliver(event):
            if event[0] != "tokens":
                reasons[i] = event
                ended[i].set()

        return deliver

    jobs = [Job(s, deliver_to(i)) for i, s in enumerate(samplings)]
    for job in jobs:  # all queued before the thread starts: the first batch takes what fits
        scheduler.submit(job)
    scheduler.start()
    for event in ended:
        assert event.wait(300)
    scheduler.stop()
    return jobs, reasons, metrics


def test_concurrent_greedy_and_sampled_requests_each_equal_their_solo_tokens():
    _, _, program = tiny_program("llama", mode="sd")
    ids, _ = prompts(10, 12, seed=11)
    lengths = [3, 12, 7, 5, 9, 11, 4, 8, 6, 10]
    samplings = [Sampling(ids[i, :n].tolist(), 6 + 3 * i) for i, n in enumerate(lengths)]
    samplings[4] = Sampling(ids[4, :9].tolist(), 15, temperature=0.8, seed=3)
    jobs, reasons, metrics = run_jobs(program, samplings, max_batch=4)
    for job, reason in zip(jobs, reasons):
        s = job.sampling
        assert job.tokens == solo(program, s.prompt_ids, s.max_tokens, s.temperature, s.seed)
        assert reason[0] == "done" and reason[1] in ("stop", "length")
    # 9 greedy requests, at most 4 rows at once: back to back that is at least 3 batches and the sampled one's;
    # here the greedy rows joined a running batch as others left, and the sampled one ran beside them
    assert 2 <= metrics.batches < 4
    assert (
        metrics.batch_rows.count > 0
        and max(b for b, n in zip(metrics.batch_rows.buckets, metrics.batch_rows.counts) if n) <= 4
    )


def test_greedy_batch_in_ssd_mode_equals_solo():
    _, _, program = tiny_program("llama", mode="ssd", lane="thread", sd_when_faster=False)
    ids, _ = prompts(4, 10, seed=12)
    samplings = [Sampling(ids[i, : 4 + 2 * i].tolist(), 10 + 4 * i) for i in range(4)]
    try:
        jobs, _, metrics = run_jobs(program, samplings)
        for job in jobs:
            assert job.tokens == solo(program, job.sampling.prompt_ids, job.sampling.max_tokens)
        assert metrics.batches == 1
    finally:
        program.close()


def test_sampled_requests_of_one_temperature_share_a_batch_seeded_or_not():
    _, _, program = tiny_program("llama", mode="sd")
    ids, _ = prompts(5, 8, seed=13)
    samplings = [Sampling(ids[i].tolist(), 6, temperature=0.7) for i in range(3)]
    samplings += [
        Sampling(ids[3].tolist(), 6, temperature=0.7, seed=1),
        Sampling(ids[4].tolist(), 6, temperature=0.5),
    ]
    jobs, reasons, metrics = run_jobs(program, samplings)
    assert all(reason[0] == "done" for reason in reasons) and all(1 <= len(j.tokens) <= 6 for j in jobs)
    assert (
        metrics.batches == 2
    )  # the four at 0.7 together (one generator per row), the one at 0.5 beside them
    assert jobs[3].tokens == solo(program, ids[3].tolist(), 6, 0.7, 1)


def test_ssd_runs_a_seeded_sampled_request_in_a_batch_of_its_own():
    _, _, program = tiny_program("llama", mode="ssd", lane="thread", sd_when_faster=False)
    ids, _ = prompts(3, 8, seed=14)
    samplings = [
        Sampling(ids[0].tolist(), 6, temperature=0.7, seed=2),
        Sampling(ids[1].tolist(), 6, temperature=0.7),
        Sampling(ids[2].tolist(), 6, temperature=0.7),
    ]
    try:
        jobs, reasons, metrics = run_jobs(program, samplings)
        assert all(reason[0] == "done" for reason in reasons)
        assert metrics.batches == 2  # the seeded one alone, the two unseeded ones together
        assert jobs[0].tokens == solo(program, ids[0].tolist(), 6, 0.7, 2)
    finally:
        program.close()


def test_ssd_seeded_sampled_requests_planned_sd_share_a_batch_with_their_solo_tokens(monkeypatch):
    """Where the planner's verdict is SD, seeded sampled requests of mode ``ssd`` are not run one by one: they
    share a batch of SD rounds (a generator per row), each with the tokens ``generate`` gives it alone."""
    from saguaro.runtime.calibration import Calibration
    from saguaro.serve import continuous

    _, _, program = tiny_program("llama", mode="ssd", lane="thread", sd_when_faster=True)
    monkeypatch.setattr(Calibration, "run_as_sd", lambda self, verdict, prior: True)
    monkeypatch.setattr(
        continuous, "run_alone", lambda *args: (_ for _ in ()).throw(AssertionError("ran alone"))
    )
    ids, _ = prompts(5, 9, seed=16)
    samplings = [Sampling(ids[i].tolist(), 8 + 2 * i, temperature=0.7, seed=10 + i) for i in range(4)]
    samplings.append(Sampling(ids[4].tolist(), 12))  # greedy, beside them
    try:
        jobs, reasons, metrics = run_jobs(program, samplings)
        assert all(reason[0] == "done" for reason in reasons)
        assert metrics.batches == 2  # the four seeded rows in one batch, the greedy one in its own
        assert max(b for b, n in zip(metrics.batch_rows.buckets, metrics.batch_rows.counts) if n) >= 2
        for job in jobs:
            s = job.sampling
            assert job.tokens == solo(program, s.prompt_ids, s.max_tokens, s.temperature, s.seed)
    finally:
        program.close()


class _Batch:
    """A running batch as the loop's choice reads it: its rows."""

    def __init__(self, size):
        self.size = size


def test_each_turn_the_batch_whose_rows_had_the_least_round_time_decodes():
    from saguaro.serve.continuous import Continuous

    loop = Continuous(scheduler=None)
    loop.sessions = {"greedy": _Batch(12), "seeded": _Batch(4)}
    round_s = {"greedy": 0.012, "seeded": 0.013}  # per row: 1 ms a greedy round, 3.25 ms a seeded one
    picks = []
    for _ in range(42):
        key = loop._next_round()
        picks.append(key)
        loop._charge(key, round_s[key], loop.sessions[key].size)
    assert picks.count("seeded") == 10  # a seeded round for about 3.25 greedy ones, not one each turn
    assert abs(loop.charged["greedy"] - loop.charged["seeded"]) <= 0.00325  # within a round of each other
    least = min(loop.charged.values())
    loop.sessions["late"] = _Batch(
        1
    )  # it starts level with the least served, not at 0: no long run of its own
    round_s["late"] = 0.004
    picks = []
    for _ in range(8):
        key = loop._next_round()
        picks.append(key)
        loop._charge(key, round_s[key], loop.sessions[key].size)
    # started at 0 it would have taken all 8 turns (32 ms behind, 4 ms a round)
    assert picks.count("late") == 2 and loop.charged["late"] == least + 0.008
    assert max(loop.charged.values()) - min(loop.charged.values()) <= 0.004
    loop.sessions["late"].size = 0  # a batch with no row running takes no turn
    loop.sessions["greedy"].size = loop.sessions["seeded"].size = 0
    assert loop._next_round() is None
    loop._charge("gone", 0.01, 1)  # its round failed and it went: nothing is kept for it
    assert "gone" not in loop.charged
