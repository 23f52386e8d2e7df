"""Continuous batching through HTTP: a request sent while a long one decodes joins its batch and streams before
the long one ends; a client that disconnects mid-stream frees its row while its batch mate decodes on. Both
assert the order of the scheduler's events (never durations): the rounds are held at a boundary, through
``BatchSession.step``, until the other side of the test has acted, so neither can race the generation."""

import threading

import httpx
import pytest

from saguaro.runtime.batching import BatchSession
from tests.conftest import tiny_program
from tests.serve.server_util import solo, start

PROMPT, OTHER = "def f(x):", "import os"


@pytest.fixture(scope="module")
def served():
    _, _, program = tiny_program("llama", mode="sd")
    running = start(program, max_batch=8, max_queue=16)
    yield running
    running.stop()


def record(served, monkeypatch, names: dict) -> tuple[list, dict]:
    """Each submitted job named by its max_tokens (``names``); the events it is sent, and its row leaving,
    appended to a list in the order the scheduler's thread makes them. Returns (events, {name: job})."""
    scheduler, events, jobs = served.service.scheduler, [], {}

    def submit(*submitted, real=scheduler.submit):
        for job in submitted:
            name = names[job.sampling.max_tokens]
            jobs[name] = job
            job.deliver = lambda event, name=name, deliver=job.deliver: (
                events.append((name, event[0])),
                deliver(event),
            )
        return real(*submitted)

    def row_left(why, real=scheduler.metrics.row_left):
        events.extend((name, "left") for name, job in jobs.items() if job.leave == why and job.done)
        return real(why)

    monkeypatch.setattr(scheduler, "submit", submit)
    monkeypatch.setattr(scheduler.metrics, "row_left", row_left)
    return events, jobs


def hold_rounds(monkeypatch, until) -> None:
    """Each round waits (at most 120 s: a failure, not a hang) until ``until()`` is true."""
    real = BatchSession.step

    def step(session):
        for _ in range(1200):
            if until():
                break
            threading.Event().wait(0.1)
        return real(session)

    monkeypatch.setattr(BatchSession, "step", step)


def streamed(served, prompt, max_tokens, into: list) -> threading.Thread:
    def read():
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        with httpx.stream("POST", served.url + "/completions", json=body, timeout=300) as raw:
            into.extend(line for line in raw.iter_lines() if line)

    thread = threading.Thread(target=read)
    thread.start()
    return thread


def test_a_request_sent_while_a_long_one_decodes_streams_before_it_ends(served, monkeypatch):
    ids = served.tokenizer(PROMPT).input_ids
    assert len(solo(served.program, ids, 200)) == 200  # no EOS: the long request decodes all 200 tokens
    events, jobs = record(served, monkeypatch, {200: "long", 6: "short"})
    hold_rounds(
        monkeypatch, lambda: "short" in jobs or "long" not in jobs
    )  # the long one waits for the short
    long_lines: list = []
    long_thread = streamed(served, PROMPT, 200, long_lines)
    for _ in range(1200):
        if ("long", "tokens") in events:
            break
        threading.Event().wait(0.1)
    short = httpx.post(
        served.url + "/completions", json={"prompt": OTHER, "max_tokens": 6, "temperature": 0}, timeout=300
    ).json()
    long_thread.join(timeout=300)
    assert (
        events.index(("short", "tokens")) < events.index(("short", "done")) < events.index(("long", "done"))
    )
    assert events.index(("long", "tokens")) < events.index(("short", "tokens"))  # it joined a running batch
    assert short["choices"][0]["text"] == served.tokenizer.decode(
        solo(served.program, served.tokenizer(OTHER).input_ids, 6), skip_special_tokens=True
    )
    assert long_lines[-1] == "data: [DONE]" and jobs["long"].tokens == solo(served.program, ids, 200)
    assert served.service.metrics.batch_rows.counts[1] >= 1  # some round ran both rows (the bucket of 2)


def test_a_client_that_disconnects_mid_stream_frees_its_row_before_its_batch_ends(served, monkeypatch):
    events, jobs = record(served, monkeypatch, {200: "gone", 120: "mate"})
    # the rounds run once the leaving client has joined and the server has seen it go
    hold_rounds(
        monkeypatch,
        lambda: "mate" not in jobs or ("gone" in jobs and (jobs["gone"].leave or not jobs["gone"].tokens)),
    )
    mate_lines: list = []
    mate = streamed(served, OTHER, 120, mate_lines)
    for _ in range(1200):
        if ("mate", "tokens") in events:
            break
        threading.Event().wait(0.1)
    body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", served.url + "/completions", json=body, timeout=300) as raw:
        assert next(raw.iter_lines()).startswith("data: ")
    mate.join(timeout=300)
    assert jobs["gone"].leave == "client disconnected" and jobs["gone"].done
    assert ("gone", "left") in events and ("gone", "done") not in events
    assert events.index(("gone", "left")) < events.index(
        ("mate", "done")
    )  # freed while its batch mate decoded
    assert len(jobs["gone"].tokens) < 200
    assert jobs["mate"].tokens == solo(served.program, served.tokenizer(OTHER).input_ids, 120)
    assert mate_lines[-1] == "data: [DONE]"
    assert (
        'saguaro_rows_left_early_total{reason="client disconnected"}'
        in httpx.get(served.url.removesuffix("/v1") + "/metrics").text
    )
