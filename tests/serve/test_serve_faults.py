"""``saguaro serve`` under bad input and faults: each bad request gets a 4xx naming the field and what is
allowed, then a good request is served; a queue past --max-queue gives 429; a draft lane that dies during
a request still gives the exact answer; the key is checked; a non-loopback host needs a key."""

import json

import httpx
import openai
import pytest

from saguaro.core.errors import ConfigError
from saguaro.serve.requests import RequestError, Sampling
from saguaro.serve.scheduler import Job, Scheduler
from saguaro.serve.server import make_server
from tests.conftest import tiny_program
from tests.serve.server_util import solo, start
from tests.tiny_tokenizer import tiny_tokenizer

GOOD = {"prompt": "abc", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def served():
    _, _, program = tiny_program("llama", mode="sd")
    running = start(program, max_batch=4, max_queue=8)
    yield running
    running.stop()


BAD = [  # (body, status, words the message must hold)
    (b"{not json", 400, ["not valid JSON"]),
    (b"[1, 2]", 400, ["JSON list", "object"]),
    (json.dumps({"prompt": 5}).encode(), 400, ["prompt", "string or a list of token ids"]),
    (json.dumps({"prompt": ""}).encode(), 400, ["prompt is empty"]),
    (json.dumps({"prompt": [1, 500]}).encode(), 400, ["outside the vocabulary [0, 128)"]),
    (json.dumps({"prompt": "x" * 300}).encode(), 400, ["300 tokens", "at most 255"]),
    (json.dumps({**GOOD, "max_tokens": "ten"}).encode(), 400, ["max_tokens='ten'", "integer >= 1"]),
    (json.dumps({**GOOD, "max_tokens": 0}).encode(), 400, ["max_tokens=0", "integer >= 1"]),
    (json.dumps({"prompt": "abc", "max_tokens": 400}).encode(), 400, ["max_tokens=400", "at most 253"]),
    (json.dumps({**GOOD, "temperature": -1}).encode(), 400, ["temperature=-1", "0..2"]),
    (json.dumps({**GOOD, "seed": "s"}).encode(), 400, ["seed='s'", "integer"]),
    (json.dumps({**GOOD, "stop": 3}).encode(), 400, ["stop=3", "string"]),
    (json.dumps({**GOOD, "stop": [str(i) for i in range(17)]}).encode(), 400, ["stop=", "at most 16"]),
    (json.dumps({**GOOD, "n": 0}).encode(), 400, ["n=0", "1..128"]),
    (
        json.dumps({**GOOD, "n": 13}).encode(),
        400,
        ["13 choices", "at most 12"],
    ),  # past --max-batch + --max-queue
    (json.dumps({**GOOD, "prompt": ["abc", [5, 6]]}).encode(), 400, ["prompt of type list", "all strings"]),
    (json.dumps({**GOOD, "timeout": 0}).encode(), 400, ["timeout=0", "seconds > 0"]),
    (json.dumps({**GOOD, "ignore_eos": "yes"}).encode(), 400, ["ignore_eos='yes'", "true or false"]),
    (json.dumps({**GOOD, "stream": "yes"}).encode(), 400, ["stream='yes'", "true or false"]),
    (json.dumps({**GOOD, "top_p": 0}).encode(), 400, ["top_p=0", "(0, 1]"]),
    (json.dumps({**GOOD, "top_p": 1.5}).encode(), 400, ["top_p=1.5", "(0, 1]"]),
    (json.dumps({**GOOD, "top_k": -3}).encode(), 400, ["top_k=-3", "integer >= 0"]),
    (json.dumps({**GOOD, "min_p": "x"}).encode(), 400, ["min_p='x'", "[0, 1]"]),
    (json.dumps({**GOOD, "presence_penalty": 2.5}).encode(), 400, ["presence_penalty=2.5", "[-2, 2]"]),
    (json.dumps({**GOOD, "logit_bias": {"500": 1}}).encode(), 400, ["logit_bias token id 500", "0..127"]),
    (json.dumps({**GOOD, "logit_bias": {"5": 200}}).encode(), 400, ["logit_bias[5]=200", "-100..100"]),
    (json.dumps({**GOOD, "logit_bias": [1]}).encode(), 400, ["logit_bias=[1]", "object"]),
    (json.dumps({**GOOD, "logprobs": 21}).encode(), 400, ["logprobs=21", "integer 0..20"]),
    (json.dumps({**GOOD, "best_of": 2}).encode(), 400, ["best_of=2", "not supported"]),
    (json.dumps({**GOOD, "suffix": "abc"}).encode(), 400, ["suffix='abc'", "not supported"]),
    (
        json.dumps({**GOOD, "response_format": {"type": "yaml"}}).encode(),
        400,
        ["response_format=", "text, json_object or json_schema"],
    ),
    (
        json.dumps({**GOOD, "response_format": {"type": "json_object"}, "max_tokens": 0}).encode(),
        400,
        ["max_tokens=0"],
    ),
    (json.dumps({**GOOD, "prompt": "a" * (1 << 20)}).encode(), 413, ["at most 1048576"]),
]


@pytest.mark.parametrize("body,status,words", BAD, ids=[str(i) for i in range(len(BAD))])
def test_each_bad_request_gets_its_4xx_and_then_a_good_one_is_served(served, body, status, words):
    answer = httpx.post(
        served.url + "/completions", content=body, headers={"content-type": "application/json"}
    )
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert all(w in error["message"] for w in words), error["message"]
    assert error["code"] == status and set(error) == {"message", "type", "param", "code"}
    good = httpx.post(served.url + "/completions", json=GOOD, timeout=120)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1


def test_bad_chat_requests(served):
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
    for body, words, param in (
        ({"messages": "hi"}, ["messages must be a non-empty list"], "messages"),
        (
            {"messages": [{"role": "user"}]},
            ["messages[0].content=None", "string or a list of text parts"],
            "messages[0].content",
        ),
        ({"messages": [{"content": "hi"}]}, ["messages[0]", "string role"], "messages[0]"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": [image]}]},
            ["messages[1].content[0]", "only text parts", "'image_url'"],
            "messages[1].content",
        ),
    ):
        answer = httpx.post(served.url + "/chat/completions", json=body)
        assert answer.status_code == 400 and all(w in answer.json()["error"]["message"] for w in words), (
            answer.text
        )
        assert answer.json()["error"]["param"] == param


def test_chat_without_a_template_says_so():
    _, _, program = tiny_program("llama", mode="sd")
    running = start(program, tokenizer=tiny_tokenizer())
    try:
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            openai.OpenAI(base_url=running.url, api_key="x", max_retries=0).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
    finally:
        running.stop()


def test_past_max_batch_and_max_queue_a_request_gets_429_with_retry_after():
    _, _, program = tiny_program("llama", mode="sd")
    scheduler = Scheduler(
        program, metrics=None, max_batch=1, max_queue=2
    )  # not started: nothing leaves the queue
    for _ in range(3):  # one for the batch's row, two waiting
        scheduler.submit(Job(Sampling([5, 6], 3), deliver=lambda event: None))
    with pytest.raises(RequestError) as refused:
        scheduler.submit(Job(Sampling([5, 6], 3), deliver=lambda event: None))
    assert refused.value.status == 429 and "--max-queue 2" in refused.value.message
    assert refused.value.headers == {"Retry-After": "1"} and scheduler.queue_depth == 3
    fresh = Scheduler(program, metrics=None, max_batch=2, max_queue=1)
    with pytest.raises(RequestError) as refused:  # a request's choices are accepted together or not at all
        fresh.submit(*[Job(Sampling([5, 6], 3), deliver=lambda event: None) for _ in range(2)])
        fresh.submit(*[Job(Sampling([5, 6], 3), deliver=lambda event: None) for _ in range(2)])
    assert refused.value.status == 429 and fresh.queue_depth == 2


def test_a_draft_lane_that_dies_during_a_request_still_gives_the_exact_answer(monkeypatch):
    from saguaro.runtime.draft import tree
    from tests.runtime.test_lane_failure import failing_after

    _, _, program = tiny_program("llama", k=3, mode="ssd", lane="thread", sd_when_faster=False)
    tokenizer = tiny_tokenizer()
    ids = tokenizer("def f(x):").input_ids
    expected = tokenizer.decode(solo(program, ids, 24), skip_special_tokens=True)  # also the lane's warm-up
    running = start(program, tokenizer=tokenizer)
    failures_before = program.lanes.failed_lanes
    try:
        monkeypatch.setattr(tree, "build_speculations", failing_after(2, RuntimeError("draft device lost")))
        body = {"prompt": "def f(x):", "max_tokens": 24, "temperature": 0}
        with pytest.warns(RuntimeWarning, match="draft device lost.*SD"):
            answer = httpx.post(running.url + "/completions", json=body, timeout=120)
        assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == expected
        running.wait_idle()
        assert running.service.scheduler.lane_failures == failures_before + 1
        assert (
            f"saguaro_draft_lane_failures_total {failures_before + 1}"
            in httpx.get(running.url.removesuffix("/v1") + "/metrics").text
        )
        monkeypatch.undo()
        again = httpx.post(running.url + "/completions", json=body, timeout=120)
        assert again.json()["choices"][0]["text"] == expected
    finally:
        running.stop()
        program.close()


def test_a_wrong_or_missing_key_gets_401():
    _, _, program = tiny_program("llama", mode="sd")
    running = start(program, api_key="s3cret")
    try:
        with pytest.raises(openai.AuthenticationError, match="wrong API key"):
            openai.OpenAI(base_url=running.url, api_key="wrong", max_retries=0).completions.create(
                model="tiny", prompt="abc", max_tokens=2
            )
        assert httpx.get(running.url + "/models").status_code == 401
        assert (
            httpx.get(running.url.removesuffix("/v1") + "/health").status_code == 200
        )  # open without --auth-health
        out = openai.OpenAI(base_url=running.url, api_key="s3cret", max_retries=0).completions.create(
            model="tiny", prompt="abc", max_tokens=2, temperature=0
        )
        assert out.usage.completion_tokens >= 1
    finally:
        running.stop()


def test_a_non_loopback_host_without_a_key_is_refused_at_start():
    _, _, program = tiny_program("llama", mode="sd")
    with pytest.raises(ConfigError, match="'0.0.0.0' is not a loopback address.*--api-key-file"):
        make_server(program, tiny_tokenizer(), "tiny", host="0.0.0.0")
    make_server(
        program, tiny_tokenizer(), "tiny", host="0.0.0.0", api_key="k"
    )  # with a key: allowed (not run)
