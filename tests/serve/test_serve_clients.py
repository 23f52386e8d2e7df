"""``saguaro serve`` takes what the clients people point at it send: ``n`` choices and prompt lists (each choice's
``index`` as OpenAI sets it, streamed chunks interleaved), chat content as text parts and assistant tool calls,
unknown vendor fields ignored and logged once, ``ignore_eos``, ``max_tokens`` defaulting to the room the prompt
leaves (or ``--max-tokens-default``), 16 stop strings. Every text is checked against ``program.generate``."""

import logging

import httpx
import openai
import pytest
import torch

from saguaro.cli.main import build_parser, subcommands
from saguaro.serve.requests import Limits, sampling_fields
from tests.conftest import tiny_program
from tests.serve.server_util import chat_tokenizer, solo, start

PROMPT, OTHER = "def f(x):", "import os"


@pytest.fixture(scope="module")
def served():
    _, _, program = tiny_program("llama", mode="sd")
    running = start(program, max_batch=8, max_queue=16)
    yield running
    running.stop()


def client(running):
    return openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0)


def expected(running, ids, max_tokens, **sampling):
    tokens = solo(running.program, ids, max_tokens, **sampling)
    return running.tokenizer.decode(tokens, skip_special_tokens=True), len(tokens)


def test_completions_with_n_2_give_two_indexed_choices_each_generate_alone(served):
    ids = served.tokenizer(PROMPT).input_ids
    out = client(served).completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, n=2)
    text, count = expected(served, ids, 12)
    assert [(c.index, c.text) for c in out.choices] == [(0, text), (1, text)]  # greedy: the same twice
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 2 * count)  # the prompt once
    seeded = client(served).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.9, seed=7, n=2
    )
    # choice j samples with seed + j: choice 0 is the request's own seed
    assert [c.text for c in seeded.choices] == [
        expected(served, ids, 12, temperature=0.9, seed=s)[0] for s in (7, 8)
    ]
    assert seeded.choices[0].text != seeded.choices[1].text


def test_a_prompt_list_gives_index_prompt_times_n_plus_j(served):
    prompts = [PROMPT, OTHER]
    out = client(served).completions.create(model="tiny", prompt=prompts, max_tokens=9, temperature=0, n=2)
    ids = [served.tokenizer(p).input_ids for p in prompts]
    want = [expected(served, i, 9) for i in ids]
    assert [(c.index, c.text) for c in out.choices] == [
        (i * 2 + j, want[i][0]) for i in range(2) for j in range(2)
    ]
    assert out.usage.prompt_tokens == len(ids[0]) + len(ids[1])
    assert out.usage.completion_tokens == 2 * (want[0][1] + want[1][1])
    raw = httpx.post(
        served.url + "/completions",
        json={"prompt": ids, "max_tokens": 9, "temperature": 0, "echo": True},
        timeout=120,
    ).json()  # token-id lists
    assert [(c["index"], c["text"]) for c in raw["choices"]] == [
        (i, prompts[i] + want[i][0]) for i in range(2)
    ]


def test_streaming_n_2_over_two_prompts_interleaves_chunks_carrying_their_index(served):
    prompts = [PROMPT, OTHER]
    chunks = list(
        client(served).completions.create(
            model="tiny",
            prompt=prompts,
            max_tokens=15,
            temperature=0,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts, finishes, order = {}, {}, []
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + choice.text
        order.append(choice.index)
        if choice.finish_reason is not None:
            finishes[choice.index] = finishes.get(choice.index, 0) + 1
    want = [expected(served, served.tokenizer(p).input_ids, 15) for p in prompts]
    assert texts == {i * 2 + j: want[i][0] for i in range(2) for j in range(2)}
    assert finishes == {0: 1, 1: 1, 2: 1, 3: 1}  # one finish chunk per choice
    assert order.index(3) < len(order) - 1 - order[::-1].index(0)  # choice 3 streamed before choice 0 ended
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * (want[0][1] + want[1][1])


def test_chat_takes_text_parts_and_n(served):
    parts = [{"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}]
    out = client(served).chat.completions.create(
        model="tiny", messages=parts, max_tokens=10, temperature=0, n=2
    )
    joined = [
        {"role": "user", "content": "hel\nlo"}
    ]  # text parts are joined with newlines, as vLLM joins them
    ids = served.tokenizer.apply_chat_template(
        joined, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    text, count = expected(served, list(ids), 10)
    assert [(c.index, c.message.content) for c in out.choices] == [(0, text), (1, text)]
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 2 * count)


def test_an_assistant_message_with_tool_calls_and_null_content_is_formatted(served):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "user", "content": "go"},
    ]
    out = httpx.post(
        served.url + "/chat/completions",
        json={"messages": messages, "max_tokens": 6, "temperature": 0},
        timeout=120,
    )
    assert out.status_code == 200, out.text
    as_template = [messages[0], {**messages[1], "content": ""}, messages[2]]
    ids = served.tokenizer.apply_chat_template(
        as_template, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert out.json()["usage"]["prompt_tokens"] == len(ids)
    assert out.json()["choices"][0]["message"]["content"] == expected(served, list(ids), 6)[0]


def test_unknown_fields_are_ignored_and_logged_once_per_name(served, caplog):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    vendor = {
        "chat_template_kwargs": {"enable_thinking": False},
        "user": "u1",
        "metadata": {"k": "v"},
        "frobnicate_once": 3,
        "ignore_eos": False,
    }
    with caplog.at_level(logging.WARNING, logger="saguaro.serve.requests"):
        answers = [httpx.post(served.url + "/completions", json=body | vendor, timeout=120) for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 200], answers[0].text
    text, _ = expected(served, served.tokenizer(PROMPT).input_ids, 8)
    assert [a.json()["choices"][0]["text"] for a in answers] == [text, text]
    logged = [r.getMessage() for r in caplog.records if r.name == "saguaro.serve.requests"]
    for name in ("'frobnicate_once'", "'chat_template_kwargs'"):
        assert sum(name in m for m in logged) == 1, logged
    assert not any(
        "'user'" in m or "'metadata'" in m for m in logged
    )  # known: accepted, no effect, not logged
    refused = httpx.post(served.url + "/completions", json=body | {"best_of": 2}, timeout=120)
    assert (
        refused.status_code == 400 and refused.json()["error"]["param"] == "best_of"
    )  # known, not implemented


def test_sixteen_stop_strings_are_honoured(served):
    ids = served.tokenizer(PROMPT).input_ids
    text, _ = expected(served, ids, 24)
    stops = [f"\u0001never{i}" for i in range(15)] + [text[6:8]]
    out = client(served).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=stops
    )
    assert out.choices[0].text == text[: text.find(text[6:8])] and out.choices[0].finish_reason == "stop"


def test_max_tokens_defaults_to_the_room_the_prompt_leaves(served):
    limits = Limits(max_length=2048, vocab_size=128)  # a model with more context than the tiny one's 256
    assert sampling_fields({}, [5] * 10, limits).max_tokens == 2038  # not 256
    assert sampling_fields({}, [5] * 10, Limits(2048, 128, default_max_tokens=7)).max_tokens == 7
    assert sampling_fields({}, [5] * 2045, Limits(2048, 128, default_max_tokens=7)).max_tokens == 3
    prompt = (PROMPT * 30)[:250]  # 250 tokens of a 256-token model: 6 left
    ids = served.tokenizer(prompt).input_ids
    room = served.program.max_length - len(ids)
    out = httpx.post(
        served.url + "/completions", json={"prompt": prompt, "temperature": 0}, timeout=120
    ).json()
    assert out["choices"][0]["text"] == expected(served, ids, room)[0]
    assert out["usage"]["completion_tokens"] == len(solo(served.program, ids, room))


def test_max_tokens_default_flag_sets_it_capped_by_the_room():
    _, _, program = tiny_program("llama", mode="sd")
    running = start(program, default_max_tokens=7)
    try:
        for prompt, budget in ((PROMPT, 7), ((PROMPT * 30)[:252], 4)):  # 252 tokens: only 4 left
            ids = running.tokenizer(prompt).input_ids
            out = httpx.post(
                running.url + "/completions", json={"prompt": prompt, "temperature": 0}, timeout=120
            ).json()
            assert out["choices"][0]["text"] == expected(running, ids, budget)[0]
            assert out["usage"]["completion_tokens"] == len(solo(program, ids, budget))
            assert (
                budget != 7 or out["usage"]["completion_tokens"] == 7
            )  # no EOS in the first 7: the flag's 7
    finally:
        running.stop()
    args = build_parser(subcommands()).parse_args(["serve", "--max-tokens-default", "7", "--auth-health"])
    assert (args.max_tokens_default, args.auth_health) == (7, True)
    assert build_parser(subcommands()).parse_args(["serve"]).max_tokens_default is None


def test_ignore_eos_decodes_past_the_end_of_sequence_token():
    _, _, program = tiny_program("llama", mode="sd")  # a Program of its own: its EOS may change
    tokenizer = chat_tokenizer()
    ids = tokenizer(PROMPT).input_ids
    free = (
        program.generate(torch.tensor([ids]), max_new_tokens=14, eos_token_id=None)
        .sequences[0, len(ids) :]
        .tolist()
    )
    program.eos_token_id = free[3]  # the token its greedy run makes 4th is now its end of sequence
    stop_at = free.index(free[3]) + 1
    running = start(program, tokenizer=tokenizer)
    try:
        body = {"prompt": PROMPT, "max_tokens": 14, "temperature": 0}
        stopped = httpx.post(running.url + "/completions", json=body, timeout=120).json()
        assert stopped["choices"][0]["finish_reason"] == "stop"
        assert stopped["usage"]["completion_tokens"] == stop_at == len(solo(program, ids, 14)) < 14
        for stream in (False, True):
            if stream:
                with httpx.stream(
                    "POST",
                    running.url + "/completions",
                    timeout=120,
                    json=body | {"ignore_eos": True, "stream": True},
                ) as raw:
                    lines = [line for line in raw.iter_lines() if line.startswith("data: {")]
                chunks = [httpx.Response(200, content=line[6:]).json()["choices"][0] for line in lines]
                text, finish = "".join(c["text"] for c in chunks), chunks[-1]["finish_reason"]
            else:
                went_on = httpx.post(
                    running.url + "/completions", json=body | {"ignore_eos": True}, timeout=120
                )
                text, finish = (
                    went_on.json()["choices"][0]["text"],
                    went_on.json()["choices"][0]["finish_reason"],
                )
                assert went_on.json()["usage"]["completion_tokens"] == 14
            assert text == tokenizer.decode(free, skip_special_tokens=True) and finish == "length"
    finally:
        running.stop()


def test_sampling_controls_are_honoured_as_generate_honours_them(served):
    """top_p, top_k, min_p, the penalties and logit_bias through the openai SDK (``extra_body`` for the fields
    OpenAI lacks): each answer is ``program.generate``'s with the same controls, greedy and seeded."""
    ids = served.tokenizer(PROMPT).input_ids
    banned = solo(served.program, ids, 4)[1]  # the greedy text's second token, biased away below
    controls = dict(top_p=0.9, frequency_penalty=1.0, presence_penalty=0.5, logit_bias={banned: -100})
    extra = dict(top_k=8, min_p=0.05, repetition_penalty=1.3)
    for temperature, seed in ((0.0, None), (0.8, 11)):
        out = client(served).completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=10,
            temperature=temperature,
            seed=seed,
            extra_body=extra,
            **controls,
        )
        want = served.program.generate(
            torch.tensor([ids]),
            max_new_tokens=10,
            temperature=temperature,
            seed=seed,
            controls=controls | extra,
        )
        tokens = want.sequences[0, len(ids) :].tolist()
        eos = served.program.eos_token_id
        eos = {eos} if isinstance(eos, int) else set(eos or ())
        cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
        assert out.choices[0].text == served.tokenizer.decode(tokens[:cut], skip_special_tokens=True)
        assert banned not in tokens
    plain = client(served).completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0)
    greedy = client(served).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, logit_bias={banned: -100}
    )
    assert greedy.choices[0].text != plain.choices[0].text  # the bias moved the greedy text
