"""Running ``saguaro serve``: every error in OpenAI's JSON shape with its status (404, 405, 500, 429 with
``Retry-After``), ``/health`` and ``/metrics`` open beside a key unless ``--auth-health``, ``--max-queue 0``
taking requests while the batch has room, a request's ``timeout`` freeing its row (408, or an error chunk
ending a stream), and ``usage["saguaro"]``: the request's own speculation figures (at a fixed ``k``:
``generate``'s alone)."""

import logging
import threading

import httpx
import openai
import pytest
import torch

from saguaro.runtime.batching import BatchSession
from tests.conftest import tiny_program
from tests.serve.server_util import start

PROMPT = "def f(x):"
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def served():
    _, _, program = tiny_program("llama", mode="sd")
    running = start(program, max_batch=4, max_queue=4)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def served_at_fixed_k():
    """A server whose SD rounds all draft the program's ``k`` (``--k-choice fixed``), as ``generate`` does."""
    _, _, program = tiny_program("llama", mode="sd")
    running = start(program, max_batch=4, max_queue=4, k_choice="fixed")
    yield running
    running.stop()


def test_usage_carries_the_rounds_a_measured_k_ran(served):
    """Under the default ``k_choice`` the rounds may draft fewer than ``k`` tokens: the figures are still those
    of the request's own rounds, alone in its batch the server's counters of them."""
    metrics = served.service.metrics
    before = (metrics.accepted_sum, metrics.accepted_rounds)
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    out = httpx.post(served.url + "/completions", json=body, timeout=120).json()
    figures, tokens = out["usage"]["saguaro"], out["usage"]["completion_tokens"]
    accepted_sum, rounds = metrics.accepted_sum - before[0], metrics.accepted_rounds - before[1]
    assert (figures["mode"], figures["ran_as"], figures["rounds"]) == ("sd", "sd", rounds) and rounds > 1
    decided = figures["mean_accepted_length"] * rounds
    assert abs(decided - accepted_sum) < 1e-6  # the prefill's token, then the rounds', the last round's cut
    assert tokens - 1 <= round(decided) <= tokens - 1 + served.program.config.k


def held_rounds(monkeypatch) -> threading.Event:
    """Every round waits (at most 120 s: a failure, not a hang) until the event returned is set."""
    release, real = threading.Event(), BatchSession.step

    def step(session):
        release.wait(120)
        return real(session)

    monkeypatch.setattr(BatchSession, "step", step)
    return release


def wait_for(condition, what: str) -> None:
    for _ in range(1200):
        if condition():
            return
        threading.Event().wait(0.05)
    raise AssertionError(f"waited in vain for {what}")


def test_unknown_routes_and_wrong_methods_answer_openai_json(served):
    base = served.url.removesuffix("/v1")
    missing = httpx.get(base + "/v1/nothing-here")
    assert missing.status_code == 404 and set(missing.json()["error"]) == ERROR_KEYS
    assert missing.json()["error"]["code"] == 404 and "/v1/nothing-here" in missing.json()["error"]["message"]
    for method, path, allow in (("GET", "/completions", {"POST"}), ("POST", "/models", {"GET", "HEAD"})):
        wrong = httpx.request(method, served.url + path)
        assert wrong.status_code == 405 and set(wrong.headers["allow"].split(", ")) == allow
        error = wrong.json()["error"]
        assert (
            set(error) == ERROR_KEYS
            and error["code"] == 405
            and f"{method} is not allowed on /v1{path}" in error["message"]
        )
    with pytest.raises(openai.NotFoundError):  # the SDK reads the shape too
        openai.OpenAI(base_url=base + "/v2", api_key="x", max_retries=0).models.list()


def test_an_unhandled_exception_answers_500_json_logs_and_the_server_serves_on(served, monkeypatch, caplog):
    async def broken(request, chat):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(served.service, "generate", broken)
    with caplog.at_level(logging.ERROR, logger="saguaro.serve.errors"):
        answer = httpx.post(served.url + "/completions", json={"prompt": PROMPT, "max_tokens": 3}, timeout=60)
    assert answer.status_code == 500
    assert answer.json()["error"] == {
        "message": "internal server error: RuntimeError: injected failure",
        "type": "server_error",
        "param": None,
        "code": 500,
    }
    (record,) = [r for r in caplog.records if r.name == "saguaro.serve.errors"]
    assert record.exc_info is not None and "injected failure" in str(record.exc_info[1])
    monkeypatch.undo()
    again = httpx.post(
        served.url + "/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0}, timeout=60
    )
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] >= 1
    assert (
        'saguaro_requests_total{status="500"} 1'
        in httpx.get(served.url.removesuffix("/v1") + "/metrics").text
    )


def test_health_and_metrics_stay_open_beside_a_key_unless_auth_health():
    _, _, program = tiny_program("llama", mode="sd")
    for auth_health, open_status in ((False, 200), (True, 401)):
        running = start(program, api_key="s3cret", auth_health=auth_health)
        base = running.url.removesuffix("/v1")
        try:
            assert [httpx.get(base + p).status_code for p in ("/health", "/metrics")] == [open_status] * 2
            keyed = {"Authorization": "Bearer s3cret"}
            assert [httpx.get(base + p, headers=keyed).status_code for p in ("/health", "/metrics")] == [
                200,
                200,
            ]
            refused = httpx.get(running.url + "/models")
            assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
            assert httpx.get(running.url + "/models", headers=keyed).status_code == 200
        finally:
            running.stop()


def test_max_queue_0_takes_requests_while_the_batch_has_room_then_429_with_retry_after(monkeypatch):
    _, _, program = tiny_program("llama", mode="sd")
    running = start(program, max_batch=2, max_queue=0)
    release = held_rounds(monkeypatch)
    answers: dict = {}

    def ask(i):
        answers[i] = httpx.post(
            running.url + "/completions",
            json={"prompt": PROMPT + str(i), "max_tokens": 6, "temperature": 0},
            timeout=120,
        )

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        scheduler = running.service.scheduler
        wait_for(lambda: scheduler.running + scheduler.queue_depth == 2, "both requests accepted")
        full = httpx.post(running.url + "/completions", json={"prompt": PROMPT, "max_tokens": 6}, timeout=60)
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        assert (
            full.json()["error"]["type"] == "rate_limit_exceeded"
            and "--max-queue 0" in full.json()["error"]["message"]
        )
        release.set()
        for t in threads:
            t.join(timeout=120)
        assert [answers[i].status_code for i in range(2)] == [200, 200]
        running.wait_idle()
        after = httpx.post(running.url + "/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=60)
        assert after.status_code == 200  # room again
    finally:
        release.set()
        running.stop()


def test_a_request_past_its_timeout_answers_408_and_frees_its_row(served, monkeypatch):
    release = held_rounds(
        monkeypatch
    )  # the rounds wait: the request runs past its timeout after its first token
    metrics = served.service.metrics
    left = metrics.rows_left.get("timeout", 0)
    body = {"prompt": PROMPT, "max_tokens": 150, "temperature": 0, "timeout": 0.5}
    try:
        answer = httpx.post(served.url + "/completions", json=body, timeout=60)
        assert answer.status_code == 408
        assert answer.json()["error"] == {
            "message": "the request ran past its timeout of 0.5 s and was cancelled",
            "type": "timeout",
            "param": "timeout",
            "code": 408,
        }
        release.set()
        served.wait_idle()
        assert metrics.rows_left.get("timeout", 0) == left + 1  # its row left before its 150 tokens
        release.clear()
        with httpx.stream(
            "POST", served.url + "/completions", json=body | {"stream": True}, timeout=60
        ) as raw:
            lines = [line for line in raw.iter_lines() if line]
        assert raw.status_code == 200 and lines[-1] == "data: [DONE]"
        assert httpx.Response(200, content=lines[-2][6:]).json()["error"]["code"] == 408
        release.set()
        served.wait_idle()
        assert metrics.rows_left.get("timeout", 0) == left + 2
        assert metrics.requests.get("408", 0) >= 2
    finally:
        release.set()


def test_usage_carries_the_requests_own_speculation_figures(served_at_fixed_k):
    served = served_at_fixed_k
    ids = served.tokenizer(PROMPT).input_ids
    alone = served.program.generate(torch.tensor([ids]), max_new_tokens=40, temperature=0).stats
    figures = {
        "mode": "sd",
        "ran_as": "sd",
        "rounds": alone["rounds"],
        "mean_accepted_length": alone["mean_accepted_len"],
    }
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0}
    whole = httpx.post(served.url + "/completions", json=body, timeout=120).json()
    assert whole["usage"]["saguaro"] == figures and alone["rounds"] > 1
    with httpx.stream(
        "POST",
        served.url + "/completions",
        timeout=120,
        json=body | {"stream": True, "stream_options": {"include_usage": True}},
    ) as raw:
        lines = [line for line in raw.iter_lines() if line.startswith("data: {")]
    assert httpx.Response(200, content=lines[-1][6:]).json()["usage"]["saguaro"] == figures
    two = httpx.post(served.url + "/completions", json=body | {"n": 2}, timeout=120).json()["usage"]
    figures_2 = two["saguaro"]
    assert set(figures_2) == set(figures) and (figures_2["mode"], figures_2["ran_as"]) == ("sd", "sd")
    # summed over the choices: each row's rounds decided its tokens after the prefill's, the last round's cut
    decided = round(figures_2["mean_accepted_length"] * figures_2["rounds"])
    k = served.program.config.k
    assert two["completion_tokens"] - 2 <= decided <= two["completion_tokens"] - 2 + 2 * k
