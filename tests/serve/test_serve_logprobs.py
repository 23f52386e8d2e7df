"""``saguaro serve``'s logprobs through the official ``openai`` client: the values are the target's own float32
log-softmax (``transformers``' forward, within 1e-4), before the temperature; completions' legacy shape (``echo``
with ``max_tokens`` 0 scores the prompt, as lm-evaluation-harness' loglikelihood asks) and chat's; streamed chunks
carry their tokens' logprobs; SD and SSD answer what AR answers; bad values are a 400 naming the field."""

import itertools
import math

import httpx
import openai
import pytest
import torch

from saguaro.serve.requests import Limits, RequestError, completion_request
from tests.conftest import tiny_program
from tests.serve.server_util import solo, start

PROMPT = "def f(x):"
TOL = 1e-4


@pytest.fixture(scope="module")
def served():
    target, _, program = tiny_program("llama", mode="sd")
    running = start(program, max_batch=8, max_queue=16)
    running.target = target
    yield running
    running.stop()


def client(running):
    return openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0)


def hf_logprobs(model, ids: list) -> torch.Tensor:
    """``[T, V]``: transformers' float32 log-softmax of the target's logits over ``ids``."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits.float(), dim=-1)[0]


def texts(running, ids) -> list:
    return [running.tokenizer.decode([t]) for t in ids]


def check_completion_logprobs(running, got, ids: list, start: int, top: int) -> None:
    """``got`` (completions' logprobs) holds the tokens ``ids[start:]`` with the target's values and, each, its
    ``top`` best and the chosen token, sorted; offsets count the token texts."""
    want = hf_logprobs(running.target, ids)
    assert got.tokens == texts(running, ids[start:])
    assert got.text_offset == list(itertools.accumulate([0] + [len(t) for t in got.tokens[:-1]]))
    for i, t in enumerate(ids[start:], start):
        if i == 0:  # nothing precedes the prompt's first token
            assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
            continue
        assert abs(got.token_logprobs[i - start] - want[i - 1, t].item()) < TOL, i
        values, best = want[i - 1].topk(top)
        pairs = dict(zip(best.tolist(), values.tolist())) | {t: want[i - 1, t].item()}  # the chosen one too
        expected = sorted(pairs.items(), key=lambda p: -p[1])
        dist = got.top_logprobs[i - start]
        assert list(dist) == texts(running, [b for b, _ in expected]), i
        assert all(abs(dist[running.tokenizer.decode([b])] - v) < TOL for b, v in expected)


def test_completion_logprobs_are_the_targets_log_softmax_with_the_best_sorted(served):
    ids = served.tokenizer(PROMPT).input_ids
    out = client(served).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2
    )
    new = solo(served.program, ids, 10)
    got = out.choices[0].logprobs
    check_completion_logprobs(served, got, ids + new, len(ids), 2)
    for value, dist in zip(got.token_logprobs, got.top_logprobs):
        assert len(dist) == 2 and value == max(dist.values())  # greedy: the chosen token is the best, exactly


def test_sampled_tokens_get_the_targets_values_before_the_temperature(served):
    ids = served.tokenizer(PROMPT).input_ids
    out = client(served).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.7, seed=5, logprobs=0
    )
    new = solo(served.program, ids, 12, temperature=1.7, seed=5)
    got = out.choices[0].logprobs
    check_completion_logprobs(served, got, ids + new, len(ids), 0)
    assert [list(d) for d in got.top_logprobs] == [
        [t] for t in got.tokens
    ]  # logprobs=0: the chosen token only
    want = hf_logprobs(served.target, ids + new)
    tempered = torch.log_softmax(want / 1.7, dim=-1)
    assert (
        max(
            abs(v - tempered[len(ids) + i - 1, t].item())
            for i, (v, t) in enumerate(zip(got.token_logprobs, new))
        )
        > 10 * TOL
    )  # the temperature's values would differ


def test_echo_scores_the_prompt_with_max_tokens_0_or_1_as_lm_eval_asks(served):
    ids = served.tokenizer(PROMPT).input_ids
    out = client(served).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1, temperature=0
    )
    (choice,) = out.choices
    assert choice.text == PROMPT and choice.finish_reason == "length" and out.usage.completion_tokens == 0
    check_completion_logprobs(served, choice.logprobs, ids, 0, 1)
    one = (
        client(served)
        .completions.create(model="tiny", prompt=PROMPT, max_tokens=1, echo=True, logprobs=1, temperature=0)
        .choices[0]
        .logprobs
    )
    check_completion_logprobs(served, one, ids + solo(served.program, ids, 1), 0, 1)
    assert (
        len(one.tokens) == len(ids) + 1 and one.token_logprobs[: len(ids)] == choice.logprobs.token_logprobs
    )
    plain = httpx.post(
        served.url + "/completions", json={"prompt": ids, "max_tokens": 0, "echo": True}
    ).json()
    assert plain["choices"][0]["text"] == PROMPT and plain["choices"][0]["logprobs"] is None


def test_chat_logprobs_with_top_logprobs(served):
    messages = [{"role": "user", "content": "hello"}]
    out = client(served).chat.completions.create(
        model="tiny", messages=messages, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    ids = list(
        served.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    new = solo(served.program, ids, 8)
    want = hf_logprobs(served.target, ids + new)
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == texts(served, new)
    for i, (entry, t) in enumerate(zip(content, new), len(ids)):
        assert abs(entry.logprob - want[i - 1, t].item()) < TOL and entry.bytes == list(entry.token.encode())
        values, best = want[i - 1].topk(3)
        assert [c.token for c in entry.top_logprobs] == texts(served, best.tolist())
        assert all(abs(c.logprob - v) < TOL for c, v in zip(entry.top_logprobs, values.tolist()))
        assert [c.bytes for c in entry.top_logprobs] == [list(c.token.encode()) for c in entry.top_logprobs]
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy
    plain = client(served).chat.completions.create(
        model="tiny", messages=messages, max_tokens=4, temperature=0
    )
    assert plain.choices[0].logprobs is None


def joined(chunks) -> dict:
    """Streamed completions' logprobs, concatenated over the chunks."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            for key in out:
                out[key] += getattr(chunk.choices[0].logprobs, key)
    return out


def same_values(a: list, b: list) -> bool:
    """Equal up to 1e-5 (a streamed chunk's tokens are scored over a shorter sequence), None for None."""
    return len(a) == len(b) and all((x is None and y is None) or abs(x - y) < 1e-5 for x, y in zip(a, b))


def test_streamed_completion_chunks_carry_their_tokens_logprobs(served):
    body = dict(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, logprobs=2, echo=True)
    whole = client(served).completions.create(**body).choices[0]
    chunks = list(client(served).completions.create(**body, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    assert sum(1 for c in chunks if c.choices and c.choices[0].logprobs is not None) > 2  # the prompt, rounds
    got, want = joined(chunks), whole.logprobs
    assert got["tokens"] == want.tokens and got["text_offset"] == want.text_offset
    assert same_values(got["token_logprobs"], want.token_logprobs) and got["top_logprobs"][0] is None
    for a, b in zip(got["top_logprobs"][1:], want.top_logprobs[1:]):
        assert list(a) == list(b) and same_values(list(a.values()), list(b.values()))
    first = next(c for c in chunks if c.choices and c.choices[0].logprobs is not None).choices[0]
    assert first.text == PROMPT and first.logprobs.tokens == texts(served, served.tokenizer(PROMPT).input_ids)


def test_streamed_chat_chunks_carry_their_tokens_logprobs(served):
    body = dict(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    whole = client(served).chat.completions.create(**body).choices[0].logprobs.content
    chunks = list(client(served).chat.completions.create(**body, stream=True))
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs is not None
        for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in whole]
    assert same_values([e.logprob for e in streamed], [e.logprob for e in whole])
    assert [[t.token for t in e.top_logprobs] for e in streamed] == [
        [t.token for t in e.top_logprobs] for e in whole
    ]


def test_a_stop_string_cuts_the_logprobs_with_the_tokens(served):
    ids = served.tokenizer(PROMPT).input_ids
    text = served.tokenizer.decode(solo(served.program, ids, 24), skip_special_tokens=True)
    stop = text[5:7]
    for stream in (False, True):
        out = client(served).completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stop=[stop],
            logprobs=1,
            stream=stream,
            **({"stream_options": {"include_usage": True}} if stream else {}),
        )
        out = list(out) if stream else out
        tokens = joined(out)["tokens"] if stream else out.choices[0].logprobs.tokens
        usage = (out[-1] if stream else out).usage
        assert len(tokens) == usage.completion_tokens and "".join(tokens).startswith(text[: text.find(stop)])


def test_a_request_run_alone_carries_logprobs_too(monkeypatch):
    """Seeded and sampled in mode ``ssd`` (planned SSD), a request runs alone (``program.stream``, which holds the
    program): its tokens are scored once the stream has ended, still in its rounds' chunks."""
    from saguaro.serve import continuous

    target, _, program = tiny_program("llama", mode="ssd", lane="thread", sd_when_faster=False)
    served = start(program, max_batch=4, max_queue=4)
    served.target = target
    try:
        alone = []
        monkeypatch.setattr(
            continuous, "run_alone", lambda *args, run=continuous.run_alone: alone.append(1) or run(*args)
        )
        ids = served.tokenizer(PROMPT).input_ids
        body = dict(
            model="tiny",
            prompt=PROMPT,
            max_tokens=10,
            temperature=0.8,
            seed=3,
            logprobs=1,
            extra_body={"top_k": 5},
        )
        whole = client(served).completions.create(**body).choices[0].logprobs
        chunks = list(client(served).completions.create(**body, stream=True))
        new = program.generate(
            torch.tensor([ids]), max_new_tokens=10, temperature=0.8, seed=3, controls={"top_k": 5}
        ).sequences[0]
        check_completion_logprobs(served, whole, new.tolist()[: len(ids) + len(whole.tokens)], len(ids), 1)
        assert joined(chunks)["tokens"] == whole.tokens and same_values(
            joined(chunks)["token_logprobs"], whole.token_logprobs
        )
        chunked = [c for c in chunks if c.choices and c.choices[0].logprobs is not None]
        assert len(chunked) > 1 and alone == [1, 1]
    finally:
        served.stop()
        program.close()


def test_requests_of_equal_sampling_controls_share_a_batch_and_get_generates_tokens(served, monkeypatch):
    """Sampling controls without a grammar join the batch session of their controls (not run alone): each
    seeded request gets what ``program.generate`` gives it alone with those controls."""
    from concurrent.futures import ThreadPoolExecutor

    from saguaro.serve import continuous

    alone, sessions = [], []
    monkeypatch.setattr(
        continuous, "run_alone", lambda *args, run=continuous.run_alone: alone.append(1) or run(*args)
    )
    made = continuous.BatchSession

    def session(*args, **kwargs):
        sessions.append(kwargs.get("controls"))
        return made(*args, **kwargs)

    monkeypatch.setattr(continuous, "BatchSession", session)
    controls = {"top_k": 5, "repetition_penalty": 1.3}
    ids = served.tokenizer(PROMPT).input_ids

    def ask(seed):
        return client(served).completions.create(
            model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.8, seed=seed, extra_body=controls
        )

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(4)))
    for seed, answer in enumerate(answers):
        out = served.program.generate(
            torch.tensor([ids]), max_new_tokens=12, temperature=0.8, seed=seed, controls=controls
        ).sequences[0, len(ids) :]
        want = served.tokenizer.decode(
            out.tolist()[: answer.usage.completion_tokens], skip_special_tokens=True
        )
        assert answer.choices[0].text == want, seed
    assert not alone and sessions and all(c is not None and c.top_k == 5 for c in sessions)


def test_sd_and_ssd_answer_the_logprobs_ar_answers(served):
    body = {"prompt": PROMPT, "max_tokens": 14, "temperature": 0, "logprobs": 3, "echo": True}
    answers = {"sd": httpx.post(served.url + "/completions", json=body, timeout=120).json()}
    for mode, options in (("ar", {}), ("ssd", {"lane": "thread", "sd_when_faster": False})):
        _, _, program = tiny_program("llama", mode=mode, **options)
        running = start(program)
        try:
            answers[mode] = httpx.post(running.url + "/completions", json=body, timeout=120).json()
        finally:
            running.stop()
            program.close()
    for mode, answer in answers.items():
        assert answer["usage"]["saguaro"]["ran_as"] == mode  # each ran its own rounds
        assert answer["choices"][0]["logprobs"] == answers["ar"]["choices"][0]["logprobs"], mode
    assert len(answers["ar"]["choices"][0]["logprobs"]["tokens"]) > len(served.tokenizer(PROMPT).input_ids)


BAD = [  # (route, fields, the param named)
    ("/completions", {"logprobs": 21}, "logprobs"),
    ("/completions", {"logprobs": -1}, "logprobs"),
    ("/completions", {"logprobs": True}, "logprobs"),
    ("/completions", {"max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ("/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/chat/completions", {"logprobs": True, "top_logprobs": -2}, "top_logprobs"),
    ("/chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ("/chat/completions", {"logprobs": 2}, "logprobs"),
    ("/chat/completions", {"max_tokens": 0, "logprobs": True}, "max_tokens"),
]


@pytest.mark.parametrize("route,fields,param", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_logprobs_values_get_a_400_naming_the_field_and_the_server_serves_on(
    served, route, fields, param
):
    base = (
        {"prompt": PROMPT} if route == "/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    )
    answer = httpx.post(
        served.url + route, json=base | {"max_tokens": 3, "temperature": 0} | fields, timeout=120
    )
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    assert f"{param}=" in answer.json()["error"]["message"]
    good = httpx.post(
        served.url + route,
        json=base | {"max_tokens": 3, "temperature": 0, "logprobs": True if route != "/completions" else 1},
        timeout=120,
    )
    assert good.status_code == 200 and good.json()["choices"][0]["logprobs"] is not None


def test_a_program_that_cannot_score_refuses_logprobs_naming_the_field():
    limits = Limits(max_length=256, vocab_size=128, scores=False)
    with pytest.raises(RequestError, match="cannot score tokens") as caught:
        completion_request({"prompt": [5, 6], "max_tokens": 2, "logprobs": 1}, None, limits)
    assert caught.value.param == "logprobs" and caught.value.status == 400
    assert completion_request({"prompt": [5, 6], "max_tokens": 2}, None, limits).choices[0].logprobs is None


def test_a_failed_scoring_fails_its_request_alone(served, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("scoring broke")

    monkeypatch.setattr(served.program, "score", broken)
    with pytest.raises(openai.InternalServerError, match="scoring broke"):
        client(served).completions.create(
            model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1
        )
    plain = client(served).completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
    assert plain.choices[0].text and plain.choices[0].logprobs is None
    monkeypatch.undo()
    served.wait_idle()
    again = client(served).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1
    )
    assert all(not math.isnan(v) for v in again.choices[0].logprobs.token_logprobs)
