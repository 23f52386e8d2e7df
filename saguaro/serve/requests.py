"""The request bodies of ``/v1/completions`` and ``/v1/chat/completions``, checked: each bad field gives a
:class:`RequestError` (an HTTP 4xx) naming the field and what is allowed."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

MAX_BODY_BYTES = 1 << 20  # a body over 1 MiB is refused (413) before it is parsed
MAX_STOP = 4  # as OpenAI: up to four stop strings
# Parameters the server does not implement, with the value that means "off": any other value is a 400.
UNSUPPORTED_DEFAULTS = {
    "top_p": (1, 1.0), "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logit_bias": ({},),
    "logprobs": (False, 0), "top_logprobs": (0,), "best_of": (1,), "suffix": ("",), "tools": ([],),
    "tool_choice": ("none", "auto"), "response_format": ({"type": "text"},), "parallel_tool_calls": (True, False),
    "functions": ([],), "function_call": ("none", "auto"), "min_p": (0, 0.0), "top_k": (0, -1),
    "repetition_penalty": (1, 1.0),
}
IGNORED = {"user", "metadata", "store", "service_tier", "stream_options"}  # accepted, no effect on the tokens


class RequestError(Exception):
    """A request the server refuses: ``status`` (400, 401, 404, 413, 429, ...), ``message``, and the
    ``param`` at fault (OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


@dataclass
class Sampling:
    """What one request asks the program for, and how its answer is shaped."""

    prompt_ids: list
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    stop: list = field(default_factory=list)
    echo: bool = False
    stream: bool = False
    include_usage: bool = False
    prompt_text: str = ""


def parse_json(raw: bytes) -> dict:
    if len(raw) > MAX_BODY_BYTES:
        raise RequestError(f"the request body is {len(raw)} bytes; at most {MAX_BODY_BYTES} are allowed", None, 413)
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(f"the request body is not valid JSON ({exc}); send a JSON object") from None
    if not isinstance(body, dict):
        raise RequestError(f"the request body is a JSON {type(body).__name__}; send a JSON object")
    return body


def _int(body, name, default, low, high=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        allowed = f"an integer {low}..{high}" if high is not None else f"an integer >= {low}"
        raise RequestError(f"{name}={value!r} is not allowed: it must be {allowed}", name)
    return value


def _bool(body, name):
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"{name}={value!r} is not allowed: it must be true or false", name)
    return value


def check_unsupported(body: dict, known: set) -> None:
    for name, value in body.items():
        if name in known or name in IGNORED or value is None:
            continue
        if name in UNSUPPORTED_DEFAULTS:
            if value not in UNSUPPORTED_DEFAULTS[name]:
                raise RequestError(f"{name}={value!r} is not supported by this server; leave it out (or at its "
                                   f"default, {UNSUPPORTED_DEFAULTS[name][0]!r})", name)
            continue
        raise RequestError(f"{name!r} is not a parameter this server supports; supported: {', '.join(sorted(known))}",
                           name)


COMMON = {"model", "max_tokens", "max_completion_tokens", "temperature", "seed", "stop", "n", "stream"}


@dataclass(frozen=True)
class Limits:
    """What the program allows: ``max_length`` (prompt + new tokens), ``vocab_size``, and the ``max_tokens``
    a request that names none gets (at most what is left after its prompt)."""

    max_length: int
    vocab_size: int
    default_max_tokens: int = 256


def sampling_fields(body: dict, prompt_ids: list, limits: Limits) -> Sampling:
    """The fields every endpoint shares, checked against the program's limits."""
    max_length, default_max_tokens = limits.max_length, limits.default_max_tokens
    if not prompt_ids:
        raise RequestError("the prompt is empty: give at least one token of text", "prompt")
    _int(body, "n", 1, 1, 1)
    room = max_length - len(prompt_ids)
    if room < 1:
        raise RequestError(f"the prompt is {len(prompt_ids)} tokens; this model takes at most {max_length - 1} "
                           "(prompt + max_tokens <= " f"{max_length})", "prompt")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, name, min(default_max_tokens, room), 1)
    if len(prompt_ids) + max_tokens > max_length:
        raise RequestError(f"{name}={max_tokens} with a prompt of {len(prompt_ids)} tokens exceeds the model's "
                           f"{max_length} tokens: {name} must be at most {room}", name)
    temperature = body.get("temperature", 1.0)
    temperature = 1.0 if temperature is None else temperature
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or not 0 <= temperature <= 2:
        raise RequestError(f"temperature={temperature!r} is not allowed: it must be a number 0..2", "temperature")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise RequestError(f"seed={seed!r} is not allowed: it must be an integer 0..2**63-1", "seed")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(f"stop={body.get('stop')!r} is not allowed: give a non-empty string or a list of at most "
                           f"{MAX_STOP} of them", "stop")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError(f"stream_options={options!r} is not allowed: give an object", "stream_options")
    return Sampling(prompt_ids, max_tokens, float(temperature), seed, stop, stream=_bool(body, "stream"),
                    include_usage=bool(options.get("include_usage")))


def completion_request(body: dict, tokenizer, limits: Limits) -> Sampling:
    """``/v1/completions``: ``prompt`` is a string, a list of token ids, or a list holding one of them."""
    check_unsupported(body, COMMON | {"prompt", "echo"})
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError("this server has no tokenizer: give the prompt as a list of token ids", "prompt")
        ids, text = tokenizer(prompt).input_ids, prompt
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids, text = list(prompt), None
    else:
        raise RequestError(f"prompt of type {type(prompt).__name__} is not allowed: give a string or a list of token "
                           "ids (one prompt: n=1, no batches)", "prompt")
    if any(not 0 <= t < limits.vocab_size for t in ids):
        raise RequestError(f"prompt holds token ids outside the vocabulary [0, {limits.vocab_size})", "prompt")
    sampling = sampling_fields(body, ids, limits)
    sampling.echo = _bool(body, "echo")
    sampling.prompt_text = text if text is not None else (tokenizer.decode(ids) if tokenizer is not None else "")
    return sampling


def chat_request(body: dict, tokenizer, limits: Limits) -> Sampling:
    """``/v1/chat/completions``: ``messages`` through the tokenizer's chat template."""
    check_unsupported(body, COMMON | {"messages"})
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model's tokenizer has no chat template, so /v1/chat/completions cannot format "
                           "messages; use /v1/completions with a prompt", "messages")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects", "messages")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise RequestError(f"messages[{i}] is not allowed: each message is an object with a string role and a "
                               "string content", f"messages[{i}]")
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    except Exception as exc:  # noqa: BLE001 - a template error is the request's fault (e.g. an unknown role)
        raise RequestError(f"the chat template could not format these messages: {exc}", "messages") from None
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return sampling_fields(body, ids, limits)
