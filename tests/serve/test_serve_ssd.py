"""``saguaro serve`` in mode ``ssd`` with continuous batching: concurrent greedy requests share the draft lane's
running batch (rows joining and leaving it between rounds) and each answer is what the request gives alone
through ``program.generate``; a seeded sampled request among them runs alone and gets its solo tokens too."""

import threading

import httpx
import pytest

from tests.conftest import tiny_program
from tests.serve.server_util import solo, start

PROMPT = "def f(x):"


@pytest.fixture(scope="module")
def served():
    _, _, program = tiny_program("llama", mode="ssd", lane="thread", sd_when_faster=False)
    running = start(program, max_batch=8, max_queue=16)
    yield running
    running.stop()
    program.close()


def ask_all(served, bodies: list) -> dict:
    answers, gate = {}, threading.Barrier(len(bodies))

    def ask(i):
        gate.wait()
        answers[i] = httpx.post(served.url + "/completions", json=bodies[i], timeout=300).json()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return answers


def test_eight_concurrent_greedy_requests_in_mode_ssd_each_equal_their_solo_output(served):
    prompts = [PROMPT * (1 + i % 3) + str(i) for i in range(8)]
    budgets = [8 + 5 * i for i in range(8)]
    metrics = served.service.metrics
    batches, lookups = metrics.batches, metrics.cache_lookups
    answers = ask_all(
        served, [{"prompt": p, "max_tokens": b, "temperature": 0} for p, b in zip(prompts, budgets)]
    )
    assert metrics.batches - batches < 8  # rows shared a batch ...
    assert metrics.cache_lookups > lookups  # ... whose rounds were SSD's (lookups in the speculation cache)
    for i in range(8):
        tokens = solo(served.program, served.tokenizer(prompts[i]).input_ids, budgets[i])
        assert answers[i]["choices"][0]["text"] == served.tokenizer.decode(
            tokens, skip_special_tokens=True
        ), i
        assert answers[i]["usage"]["completion_tokens"] == len(tokens), i


def test_usage_carries_the_ssd_figures_of_the_request_alone(served):
    metrics = served.service.metrics
    before = (metrics.accepted_sum, metrics.accepted_rounds, metrics.cache_hits, metrics.cache_lookups)
    out = httpx.post(
        served.url + "/completions", json={"prompt": PROMPT, "max_tokens": 30, "temperature": 0}, timeout=300
    ).json()
    figures = out["usage"]["saguaro"]
    accepted_sum, rounds, hits, lookups = (
        after - b
        for after, b in zip(
            (metrics.accepted_sum, metrics.accepted_rounds, metrics.cache_hits, metrics.cache_lookups), before
        )
    )
    # alone in its batch, the request's rounds are the batch's: the server's counters of them say the same
    assert (figures["mode"], figures["ran_as"], figures["rounds"]) == ("ssd", "ssd", rounds) and rounds > 1
    decided = round(figures["mean_accepted_length"] * rounds)  # tokens its rounds decided: an integer
    assert (
        abs(figures["mean_accepted_length"] * rounds - decided) < 1e-9 and abs(accepted_sum - decided) < 1e-6
    )
    assert lookups > 0 and figures["cache_hit_rate"] == hits / lookups


def test_a_seeded_sampled_request_among_greedy_ones_runs_alone_with_its_solo_tokens(served):
    bodies = [{"prompt": PROMPT + str(i), "max_tokens": 12, "temperature": 0} for i in range(3)]
    bodies.append({"prompt": PROMPT, "max_tokens": 10, "temperature": 0.8, "seed": 4})
    bodies.append({"prompt": PROMPT + "x", "max_tokens": 6, "temperature": 0.8})  # unseeded: in a batch
    answers = ask_all(served, bodies)
    for i, body in enumerate(bodies[:4]):
        sampling = {"temperature": body["temperature"], "seed": body.get("seed")}
        tokens = solo(
            served.program, served.tokenizer(body["prompt"]).input_ids, body["max_tokens"], **sampling
        )
        assert answers[i]["choices"][0]["text"] == served.tokenizer.decode(
            tokens, skip_special_tokens=True
        ), i
    assert 1 <= answers[4]["usage"]["completion_tokens"] <= 6


def test_a_seeded_request_runs_alone_between_the_rounds_of_a_batch_that_runs_sd(monkeypatch):
    """Where the batch's rounds are SD's (the planner's verdict), the lane is free: a seeded sampled request runs
    alone between two of its rounds instead of waiting for its rows to end, and every answer is still solo."""
    from saguaro.runtime import batching_ssd
    from saguaro.runtime.batching import BatchSession
    from saguaro.runtime.generation_plan import GenerationPlan
    from saguaro.serve.metrics import Metrics
    from saguaro.serve.requests import Sampling
    from saguaro.serve.scheduler import Job, Scheduler
    from tests.models import prompts

    _, _, program = tiny_program("llama", mode="ssd", lane="thread", sd_when_faster=False)
    monkeypatch.setattr(
        batching_ssd, "plan_call", lambda *args: GenerationPlan("ssd", "sd", "SD, for the test")
    )
    seeded_sent, events = threading.Event(), []
    real_step = BatchSession.step

    def step(session):
        assert seeded_sent.wait(120) and session.run == "sd"
        return real_step(session)

    monkeypatch.setattr(BatchSession, "step", step)
    ids, _ = prompts(4, 8, seed=15)
    samplings = [Sampling(ids[i].tolist(), 30) for i in range(3)] + [
        Sampling(ids[3].tolist(), 8, temperature=0.7, seed=5)
    ]
    scheduler = Scheduler(program, Metrics(), max_batch=8, max_queue=16)
    jobs = [Job(s, lambda event, i=i: events.append((i, event[0]))) for i, s in enumerate(samplings)]
    try:
        scheduler.start()
        for job in jobs[:3]:
            scheduler.submit(job)
        for _ in range(1200):  # the three greedy rows have joined: their first tokens are out
            if all(job.tokens for job in jobs[:3]):
                break
            threading.Event().wait(0.1)
        scheduler.submit(jobs[3])
        seeded_sent.set()
        for _ in range(1200):
            if all(job.done for job in jobs):
                break
            threading.Event().wait(0.1)
        scheduler.stop(60)
        dones = [i for i, kind in events if kind == "done"]
        assert dones[0] == 3 and sorted(dones) == [0, 1, 2, 3]  # the seeded one ended first: it did not wait
        for job in jobs:  # on the same lane: a sampled SSD plan follows the costs its lane's warm-up measured
            s = job.sampling
            assert job.tokens == solo(program, s.prompt_ids, s.max_tokens, s.temperature, s.seed)
    finally:
        scheduler.stop(60)
        program.close()
