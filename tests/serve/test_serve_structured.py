"""Structured output and tools through ``saguaro serve``, with the clients people use: the openai SDK's ``.parse`` with
a pydantic model, ``response_format`` json_object and json_schema (chat and completions), ``tools`` under each
``tool_choice`` (whole and streamed as OpenAI streams tool calls), tool turns in the history, ``chat_template_kwargs``,
litellm's function calling, and bad input answered with a 400 naming the field while the server keeps serving.
Constrained answers are checked against ``program.generate`` under the same grammar."""

import json
import os
from typing import Literal

import httpx
import openai
import pytest
import torch
from pydantic import BaseModel, Field

from saguaro import Grammar
from saguaro.cli.main import build_parser, subcommands
from saguaro.core.errors import ConfigError
from saguaro.serve.server import read_chat_template
from saguaro.serve.tools import ToolCallStream, parse_tool_calls, tool_choice_of, tool_grammar
from tests.conftest import tiny_program
from tests.serve.server_util import start
from tests.tiny_tokenizer import tiny_tokenizer

# renders the tools' names, each turn's tool calls (arguments as the object the server hands the template) and a
# template variable from chat_template_kwargs
TEMPLATE = (
    "{% if tools %}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}\n{% endif %}"
    "{% if terse %}terse\n{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}[{{ c['function']['name'] }} "
    "{{ c['function']['arguments']['city'] if c['function']['arguments'] is mapping else 'TEXT' }}]{% endfor %}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "w", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},  # no parameters: arguments {}
]
MESSAGES = [{"role": "user", "content": "hi"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "kind": {"enum": ["a", "bb"]},
        "ok": {"type": "boolean"},
    },
    "required": ["n", "kind", "ok"],
    "additionalProperties": False,
}


class Reading(BaseModel):
    n: int = Field(ge=0, le=99)
    kind: Literal["a", "bb"]
    ok: bool


@pytest.fixture(scope="module")
def served():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    _, _, program = tiny_program("llama", mode="sd")
    running = start(program, tokenizer, max_batch=4, max_queue=8)
    yield running
    running.stop()


def client(running):
    return openai.OpenAI(base_url=running.url, api_key="unused", max_retries=0)


def chat(running, **body):
    answer = httpx.post(running.url + "/chat/completions", json={"messages": MESSAGES, **body}, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


def generated(running, prompt_ids, grammar, max_tokens, **options) -> str:
    """The text ``program.generate`` gives ``prompt_ids`` alone under ``grammar``."""
    program = running.program
    out = program.generate(
        torch.tensor([prompt_ids]), max_new_tokens=max_tokens, controls={"grammar": grammar}, **options
    )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    return running.tokenizer.decode(tokens, skip_special_tokens=True)


def prompt_ids(running, messages=MESSAGES, tools=None, **extra):
    return list(
        running.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False, **extra
        )
    )


def test_openai_parse_with_a_pydantic_model_returns_the_parsed_object(served):
    for parse in (client(served).chat.completions.parse, client(served).beta.chat.completions.parse):
        out = parse(model="tiny", messages=MESSAGES, response_format=Reading, max_tokens=80, temperature=0)
        choice = out.choices[0]
        assert isinstance(choice.message.parsed, Reading) and choice.finish_reason == "stop"
        assert Reading.model_validate_json(choice.message.content) == choice.message.parsed
        assert (
            out.usage.model_extra["saguaro"]["ran_as"] == "sd"
        )  # speculated, the draft masked as the target


def test_a_json_schema_answer_is_generates_own_under_that_grammar(served):
    """Greedy, and seeded with top_p: the text ``program.generate`` gives alone under the schema's grammar."""
    grammar = Grammar.json_schema(SCHEMA, served.tokenizer, 128)
    fmt = {"type": "json_schema", "json_schema": {"name": "reading", "schema": SCHEMA, "strict": True}}
    whole = chat(served, response_format=fmt, max_tokens=80, temperature=0)
    text = whole["choices"][0]["message"]["content"]
    assert text == generated(served, prompt_ids(served), grammar, 80)
    assert json.loads(text).keys() == SCHEMA["properties"].keys()
    sampled = chat(served, response_format=fmt, max_tokens=80, temperature=0.8, seed=5, top_p=0.9)
    controls = {"grammar": grammar, "top_p": 0.9}
    out = served.program.generate(
        torch.tensor([prompt_ids(served)]), max_new_tokens=80, temperature=0.8, seed=5, controls=controls
    )
    ids = out.sequences[0, len(prompt_ids(served)) :].tolist()
    assert sampled["choices"][0]["message"]["content"] == served.tokenizer.decode(
        ids, skip_special_tokens=True
    )
    json.loads(sampled["choices"][0]["message"]["content"])


def test_json_object_on_completions_and_chat(served):
    answer = httpx.post(
        served.url + "/completions",
        json={
            "prompt": "x = ",
            "max_tokens": 60,
            "temperature": 0,
            "response_format": {"type": "json_object"},
        },
        timeout=120,
    ).json()
    text = answer["choices"][0]["text"]
    ids = served.tokenizer("x = ").input_ids
    assert text == generated(served, ids, Grammar.json_schema(None, served.tokenizer, 128), 60)
    assert text.startswith("{")
    streamed = client(served).chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_object"},
        stream=True,
    )
    pieces = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    whole = chat(served, max_tokens=60, temperature=0, response_format={"type": "json_object"})
    assert pieces == whole["choices"][0]["message"]["content"] and pieces.startswith("{")


def check_call(call, names=("get_weather", "get_time")) -> dict:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert arguments["city"] in ("Paris", "Oslo") and 1 <= arguments["days"] <= 7
    else:
        assert arguments == {}
    return arguments


def test_tool_choice_required_named_auto_and_none(served):
    c = client(served)
    common = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=0)
    required = c.chat.completions.create(**common, tool_choice="required", parallel_tool_calls=False)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0])
    named = c.chat.completions.create(
        **common,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
    )
    (call,) = named.choices[0].message.tool_calls
    check_call(call, ("get_weather",))
    assert named.choices[0].finish_reason == "tool_calls"
    ids = prompt_ids(served, tools=TOOLS)
    for body, answer in (
        ({"tool_choice": "required"}, required),
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, named),
    ):  # the calls are what generate writes alone under the tool choice's grammar
        choice = tool_choice_of({"tools": TOOLS, "parallel_tool_calls": False, **body})
        grammar = Grammar.lark(tool_grammar(choice, Grammar.json_options), served.tokenizer, 128)
        (call,) = answer.choices[0].message.tool_calls
        head = json.dumps({"name": call.function.name, "arguments": 0})[: -len("0}")]
        text = f"<tool_call>\n{head}{call.function.arguments}}}\n</tool_call>"
        assert generated(served, ids, grammar, 120) == text
    auto = c.chat.completions.create(
        **common, tool_choice="auto"
    )  # text (or calls): a valid answer either way
    message = auto.choices[0].message
    assert (message.tool_calls is None) == (auto.choices[0].finish_reason != "tool_calls")
    assert message.content is None or "<tool_call>" not in message.content
    none = c.chat.completions.create(**common, tool_choice="none")
    assert none.choices[0].message.tool_calls is None
    plain = served.program.generate(torch.tensor([ids]), max_new_tokens=120)
    want = served.tokenizer.decode(plain.sequences[0, len(ids) :].tolist(), skip_special_tokens=True)
    assert none.choices[0].message.content == want  # no constraint: what the template with the tools gives


def test_tool_calls_stream_as_openai_streams_them(served):
    c = client(served)
    common = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=160, temperature=0)
    whole = c.chat.completions.create(**common, tool_choice="required")
    chunks = list(c.chat.completions.create(**common, tool_choice="required", stream=True))
    calls: dict = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            if delta.id is not None:  # a call's first delta: its id, type and name, arguments empty
                assert delta.type == "function" and delta.function.name and delta.function.arguments == ""
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
            else:
                calls[delta.index]["arguments"] += delta.function.arguments
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    got = [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]
    want = [(t.function.name, t.function.arguments) for t in whole.choices[0].message.tool_calls or []]
    assert got == want and got
    for chunk in chunks:  # no text content around tool calls
        assert not (chunk.choices and chunk.choices[0].delta.content)


def test_tool_turns_in_the_history_reach_the_template(served):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'},
    }
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "cold"},
    ]
    answer = httpx.post(
        served.url + "/chat/completions",
        json={"messages": messages, "tools": TOOLS, "max_tokens": 4, "temperature": 0},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    as_template = [
        messages[0],
        {
            **messages[1],
            "content": "",
            "tool_calls": [
                {**call, "function": {**call["function"], "arguments": {"city": "Oslo", "days": 2}}}
            ],
        },
        messages[2],
    ]
    ids = prompt_ids(served, as_template, TOOLS)
    assert "[get_weather Oslo]" in served.tokenizer.decode(ids)  # arguments as an object
    assert answer.json()["usage"]["prompt_tokens"] == len(ids)


def test_chat_template_kwargs_reach_the_template(served):
    plain = chat(served, max_tokens=2, temperature=0)
    terse = chat(served, max_tokens=2, temperature=0, chat_template_kwargs={"terse": True, "tokenize": False})
    assert terse["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] + len("terse\n")
    bad = httpx.post(served.url + "/chat/completions", json={"messages": MESSAGES, "chat_template_kwargs": 3})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


def test_litellm_function_calling(served):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the remote model map
    import litellm

    out = litellm.completion(
        model="openai/tiny",
        api_base=served.url,
        api_key="unused",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
    )
    calls = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and calls
    check_call(calls[0])


@pytest.mark.parametrize(
    "route, body, param",
    [
        (
            "chat",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "foo"}},
                }
            },
            "response_format",
        ),
        (
            "chat",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"required": "a"}},
                }
            },
            "response_format",
        ),
        ("completions", {"response_format": {"type": "yaml"}}, "response_format"),
        (
            "chat",
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ("chat", {"tool_choice": "required"}, "tool_choice"),
        (
            "chat",
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]},
            "tools",
        ),
        ("chat", {"tools": [{"type": "retrieval"}]}, "tools"),
        ("chat", {"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ("chat", {"top_p": 0}, "top_p"),
        ("chat", {"top_p": 1.5}, "top_p"),
        ("chat", {"top_k": -3}, "top_k"),
        ("completions", {"top_k": -1}, "top_k"),
        ("completions", {"logprobs": 21}, "logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_bad_input_gets_a_400_naming_the_field_and_the_server_keeps_serving(served, route, body, param):
    base = {"messages": MESSAGES} if route == "chat" else {"prompt": "hi"}
    path = "/chat/completions" if route == "chat" else "/completions"
    answer = httpx.post(served.url + path, json={**base, "max_tokens": 4, **body}, timeout=60)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
    assert httpx.post(served.url + path, json={**base, "max_tokens": 2}, timeout=60).status_code == 200


def test_parsing_and_streaming_tool_calls_agree():
    text = 'I will.<tool_call>\n{"name": "f", "arguments": {"a": [1, "}"]}}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "I will." and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("f", '{"a": [1, "}"]}'),
        ("g", "{}"),
    ]
    stream, deltas = ToolCallStream(), []
    for end in range(1, len(text) + 1):  # released a character at a time
        deltas += stream.deltas(text[:end], end == len(text))
    streamed_content = "".join(d.get("content", "") for d in deltas)
    arguments: dict = {}
    for d in deltas:
        for call in d.get("tool_calls", []):
            arguments[call["index"]] = arguments.get(call["index"], "") + call["function"]["arguments"]
    assert streamed_content == content and list(arguments.values()) == ['{"a": [1, "}"]}', "{}"]
    assert parse_tool_calls('<tool_call>\n{"name": "f", "argu') == ('<tool_call>\n{"name": "f", "argu', [])
    assert parse_tool_calls("plain") == ("plain", [])


def test_chat_template_flag_reads_a_file(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert read_chat_template(path) == TEMPLATE and read_chat_template(None) is None
    args = build_parser(subcommands()).parse_args(["serve", "--chat-template", str(path)])
    assert args.chat_template == str(path)
    with pytest.raises(ConfigError, match="--chat-template"):
        read_chat_template(tmp_path / "missing.jinja")


def test_mode_ssd_serves_a_structured_request_with_sd_rounds_and_says_so():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    _, _, program = tiny_program("llama", mode="ssd", lane="thread", sd_when_faster=False)
    running = start(program, tokenizer, max_batch=2, max_queue=2)
    try:
        fmt = {"type": "json_schema", "json_schema": {"name": "reading", "schema": SCHEMA}}
        whole = chat(running, response_format=fmt, max_tokens=80, temperature=0)
        grammar = Grammar.json_schema(SCHEMA, tokenizer, 128)
        assert whole["choices"][0]["message"]["content"] == generated(
            running, prompt_ids(running), grammar, 80
        )
        figures = whole["usage"]["saguaro"]
        assert figures["mode"] == "ssd" and figures["ran_as"] == "sd" and figures["mean_accepted_length"] > 1
        # seeded and sampled it joins the grammar's batch, SD's rounds, as generate runs it: generate's text
        sampled = chat(running, response_format=fmt, max_tokens=80, temperature=0.8, seed=5, top_p=0.9)
        ids = prompt_ids(running)
        out = program.generate(
            torch.tensor([ids]),
            max_new_tokens=80,
            temperature=0.8,
            seed=5,
            controls={"grammar": grammar, "top_p": 0.9},
        )
        assert sampled["choices"][0]["message"]["content"] == tokenizer.decode(
            out.sequences[0, len(ids) :].tolist(), skip_special_tokens=True
        )
        assert sampled["usage"]["saguaro"]["ran_as"] == "sd"
    finally:
        running.stop()
        program.close()


def test_a_program_without_controls_refuses_them_and_grammars_naming_the_field():
    """A loaded artifact in mode sd/ssd has no ``target.verify_logits``: its requests with sampling controls or a
    grammar get a 400 at once (not a failed generation), and plain requests still run."""
    from saguaro.serve.requests import Limits, RequestError, completion_request

    limits = Limits(max_length=256, vocab_size=128, controls=False)
    for body, param in (
        ({"top_p": 0.9}, "top_p"),
        ({"logit_bias": {"5": 2.0}}, "logit_bias"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ):
        with pytest.raises(RequestError, match="cannot apply sampling controls") as caught:
            completion_request({"prompt": [5, 6], "max_tokens": 2} | body, tiny_tokenizer(), limits)
        assert caught.value.param == param and caught.value.status == 400
    plain = completion_request({"prompt": [5, 6], "max_tokens": 2, "top_p": 1.0}, tiny_tokenizer(), limits)
    assert plain.choices[0].controls is None
    assert tiny_program("llama", mode="ar")[2].can_control and tiny_program("llama", mode="sd")[2].can_control


def test_requests_of_one_schema_share_a_batch_and_get_generates_text(served, monkeypatch):
    """A schema's grammar is kept (the same ``Grammar`` for each request of it), so its requests join one batch
    session, none run alone; each greedy answer is ``program.generate``'s alone under that grammar."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from saguaro.runtime.batching import BatchSession
    from saguaro.serve import continuous

    alone, sizes, real_step = [], [], BatchSession.step
    monkeypatch.setattr(
        continuous, "run_alone", lambda *args, run=continuous.run_alone: alone.append(1) or run(*args)
    )
    scheduler, queued = served.service.scheduler, threading.Event()

    def step(
        session, k=None
    ):  # the first round waits (120 s at most) until the other requests queue behind it
        queued.wait(120)
        if getattr(session.controls, "grammar", None) is not None:
            sizes.append(session.size)
        return real_step(session, k)

    monkeypatch.setattr(BatchSession, "step", step)
    fmt = {"type": "json_schema", "json_schema": {"name": "reading", "schema": SCHEMA}}
    questions = [[{"role": "user", "content": f"Reading {i}?"}] for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        answers = [
            pool.submit(chat, served, messages=m, response_format=fmt, max_tokens=60, temperature=0)
            for m in questions
        ]
        for _ in range(2400):
            if len(scheduler.waiting) >= 2 or all(a.done() for a in answers):
                break
            threading.Event().wait(0.05)
        queued.set()
        answers = [a.result() for a in answers]
    grammar = Grammar.json_schema(SCHEMA, served.tokenizer, 128)
    for messages, answer in zip(questions, answers):
        want = generated(served, prompt_ids(served, messages), grammar, 60)
        assert answer["choices"][0]["message"]["content"] == want
    assert not alone and max(sizes) == 3  # one batch of the three
