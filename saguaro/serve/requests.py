"""The request bodies of ``/v1/completions`` and ``/v1/chat/completions``, checked into a :class:`Request`: one
:class:`Sampling` per choice (``n`` per prompt). Lenient as vLLM, SGLang, llama-server and TGI are: a field
no route knows is ignored and logged once per name (:class:`UnknownFields`); a known field the server cannot
honour at the value given is a 400 naming it (:class:`RequestError`, ``param`` = the field), as is every bad
value of a field it reads, with what is allowed."""

from __future__ import annotations

import json
import logging
import math
import threading
from dataclasses import dataclass, field, fields, replace

from saguaro.serve.logprobs import MAX_LOGPROBS
from saguaro.serve.request_error import RequestError
from saguaro.serve.structured import Structured, grammar_of
from saguaro.serve.tools import tool_choice_of

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20  # a body over 1 MiB is refused (413) before it is parsed
MAX_STOP = 16  # stop strings per request (OpenAI allows 4; vLLM and llama-server take more)
MAX_N = 128  # choices per prompt, as OpenAI
MAX_UNKNOWN_LOGGED = 256  # distinct unknown field names remembered (and logged) per server
SEED_LIMIT = 2**63  # seeds are 0..2**63-1

SUPPORTED, IGNORED = "supported", "ignored"
# Every request field the server knows, and what it does with it: the one place a field's treatment is set.
#   SUPPORTED  read and honoured by the parsers below (``ROUTE`` says where a field belongs to one route);
#   IGNORED    accepted and changes nothing (not logged);
#   a tuple    known, not implemented: refused (400 naming it) at any value but these defaults (or null).
# Supporting a refused field: mark it SUPPORTED here and read it in :func:`sampling_fields` (as logprobs are).
FIELDS: dict = {
    "model": SUPPORTED,
    "max_tokens": SUPPORTED,
    "max_completion_tokens": SUPPORTED,
    "temperature": SUPPORTED,
    "seed": SUPPORTED,
    "stop": SUPPORTED,
    "n": SUPPORTED,
    "stream": SUPPORTED,
    "stream_options": SUPPORTED,
    "ignore_eos": SUPPORTED,
    "timeout": SUPPORTED,
    "prompt": SUPPORTED,
    "echo": SUPPORTED,
    "messages": SUPPORTED,
    "user": IGNORED,
    "metadata": IGNORED,
    "store": IGNORED,
    "service_tier": IGNORED,
    "top_p": SUPPORTED,
    "top_k": SUPPORTED,
    "min_p": SUPPORTED,
    "presence_penalty": SUPPORTED,
    "frequency_penalty": SUPPORTED,
    "repetition_penalty": SUPPORTED,
    "logit_bias": SUPPORTED,
    "logprobs": SUPPORTED,
    "top_logprobs": SUPPORTED,
    "tools": SUPPORTED,
    "tool_choice": SUPPORTED,
    "parallel_tool_calls": SUPPORTED,
    "response_format": SUPPORTED,
    "chat_template_kwargs": SUPPORTED,
    "best_of": (1,),
    "suffix": ("",),
    "functions": ([],),
    "function_call": ("none", "auto"),
}
ROUTE = {
    "prompt": "completions",
    "echo": "completions",
    "messages": "chat",
    "top_logprobs": "chat",
    "tools": "chat",
    "tool_choice": "chat",
    "parallel_tool_calls": "chat",
    "chat_template_kwargs": "chat",
}  # elsewhere: unknown fields
# chat_template_kwargs that would change how the template is called rather than what it renders: left out
TEMPLATE_CALL_KEYS = {
    "conversation",
    "messages",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
}


@dataclass
class Sampling:
    """What one choice asks the program for (one job of the scheduler), and how its answer is shaped."""

    prompt_ids: list
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None
    stop: list = field(default_factory=list)
    echo: bool = False
    stream: bool = False
    include_usage: bool = False
    prompt_text: str = ""
    ignore_eos: bool = False  # decode past the end-of-sequence token, to max_tokens
    controls: object = (
        None  # a saguaro.SamplingControls, or None: the temperature alone (runs alone: alone.py)
    )
    logprobs: int | None = (
        None  # the target's logprobs with this many alternatives per token (None: not asked)
    )
    tools: object = None  # a serve.tools.ToolChoice whose calls the answer is parsed for (chat), or None


@dataclass
class Request:
    """A checked request: ``choices`` in OpenAI's index order (completions: prompt ``i``'s ``j``-th sample is
    ``i * n + j``; chat: ``0..n-1``), ``prompt_tokens`` (each prompt counted once), ``timeout`` (seconds from
    arrival, or None), and the shape of its answer (``stream``, ``include_usage``)."""

    choices: list
    prompt_tokens: int
    timeout: float | None = None
    stream: bool = False
    include_usage: bool = False


class UnknownFields:
    """The request fields a route does not know: ignored, each name logged once (WARNING) per server; after
    :data:`MAX_UNKNOWN_LOGGED` names no more are remembered (a client cannot grow it without bound)."""

    def __init__(self):
        self.logged: set = set()
        self.lock = threading.Lock()

    def seen(self, name: str, route: str) -> None:
        with self.lock:
            if name in self.logged or len(self.logged) > MAX_UNKNOWN_LOGGED:
                return
            self.logged.add(name)
            full = len(self.logged) > MAX_UNKNOWN_LOGGED
        log.warning(
            "request field %r is not one /v1/%s knows: it is ignored (logged once per field name)",
            name[:80],
            "chat/completions" if route == "chat" else "completions",
        )
        if full:
            log.warning(
                "more than %d unknown request field names seen: no more are logged", MAX_UNKNOWN_LOGGED
            )


def parse_json(raw: bytes) -> dict:
    if len(raw) > MAX_BODY_BYTES:
        raise RequestError(
            f"the request body is {len(raw)} bytes; at most {MAX_BODY_BYTES} are allowed", None, 413
        )
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
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < low
        or (high is not None and value > high)
    ):
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


def check_fields(body: dict, route: str, unknown: UnknownFields | None = None) -> None:
    """Refuse a known, unimplemented field at a value other than its default (400 naming it); hand each field
    ``route`` (``"completions"`` or ``"chat"``) does not know to ``unknown`` (ignored, logged once)."""
    for name, value in body.items():
        policy = FIELDS.get(name)
        if policy is None or ROUTE.get(name, route) != route:
            if unknown is not None:
                unknown.seen(name, route)
            continue
        if isinstance(policy, tuple) and value is not None and value not in policy:
            raise RequestError(
                f"{name}={value!r} is not supported by this server; leave it out (or at its "
                f"default, {policy[0]!r})",
                name,
            )


@dataclass(frozen=True)
class Limits:
    """What the program allows: ``max_length`` (prompt + new tokens), ``vocab_size``, the ``max_tokens`` a
    request that names none gets: ``default_max_tokens`` (``--max-tokens-default``), at most the room its prompt
    leaves; None: all that room; and whether it ``scores`` tokens (logprobs; a loaded artifact does not)."""

    max_length: int
    vocab_size: int
    default_max_tokens: int | None = None
    scores: bool = True  # the program can score tokens (logprobs): Program.can_score
    structured: object = None  # a serve.structured.Structured (None: one made from the tokenizer when asked)
    controls: bool = True  # the program applies sampling controls and grammars: Program.can_control


def sampling_fields(
    body: dict, prompt_ids: list, limits: Limits, echo: bool = False, chat: bool = False
) -> Sampling:
    """The fields every endpoint shares, for one prompt, checked against the program's limits; ``echo``: the
    completion's (``max_tokens`` may then be 0: the prompt scored, nothing generated); ``chat``: the route's
    (its logprobs fields: :func:`logprobs_field`)."""
    max_length, default_max_tokens = limits.max_length, limits.default_max_tokens
    if not prompt_ids:
        raise RequestError("the prompt is empty: give at least one token of text", "prompt")
    room = max_length - len(prompt_ids)
    if room < 1:
        raise RequestError(
            f"the prompt is {len(prompt_ids)} tokens; this model takes at most {max_length - 1} "
            "(prompt + max_tokens <= "
            f"{max_length})",
            "prompt",
        )
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    default = room if default_max_tokens is None else min(default_max_tokens, room)
    if type(body.get(name)) is int and body[name] == 0 and not echo:
        raise RequestError(
            f"{name}=0 is not allowed: it must be an integer >= 1 (0 only on /v1/completions with "
            "echo: true, which scores the prompt and generates nothing)",
            name,
        )
    max_tokens = _int(body, name, default, 0 if echo else 1)
    if len(prompt_ids) + max_tokens > max_length:
        raise RequestError(
            f"{name}={max_tokens} with a prompt of {len(prompt_ids)} tokens exceeds the model's "
            f"{max_length} tokens: {name} must be at most {room}",
            name,
        )
    temperature = body.get("temperature", 1.0)
    temperature = 1.0 if temperature is None else temperature
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, (int, float))
        or not math.isfinite(temperature)
        or not 0 <= temperature <= 2
    ):
        raise RequestError(
            f"temperature={temperature!r} is not allowed: it must be a number 0..2", "temperature"
        )
    seed = body.get("seed")
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < SEED_LIMIT
    ):
        raise RequestError(f"seed={seed!r} is not allowed: it must be an integer 0..2**63-1", "seed")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(
            f"stop={body.get('stop')!r} is not allowed: give a non-empty string or a list of at most "
            f"{MAX_STOP} of them",
            "stop",
        )
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError(f"stream_options={options!r} is not allowed: give an object", "stream_options")
    return Sampling(
        prompt_ids,
        max_tokens,
        float(temperature),
        seed,
        stop,
        echo=echo,
        stream=_bool(body, "stream"),
        include_usage=bool(options.get("include_usage")),
        ignore_eos=_bool(body, "ignore_eos"),
        controls=sampling_controls(body, limits),
        logprobs=logprobs_field(body, chat, limits),
    )


def logprobs_field(body: dict, chat: bool, limits: Limits) -> int | None:
    """The alternatives per token a request's logprobs ask for, or None where it asks for none. Chat: ``logprobs``
    true or false, ``top_logprobs`` 0..20 (only with ``logprobs`` true, as vLLM; default 0); completions:
    ``logprobs`` 0..20 (OpenAI's legacy field; false or null: none). A 400 names the field at fault, and
    ``logprobs`` where the program cannot score (a loaded artifact)."""
    if chat:
        asked = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", 0, 0, MAX_LOGPROBS)
        if body.get("top_logprobs") is not None and not asked:
            raise RequestError(
                f"top_logprobs={body['top_logprobs']!r} is not allowed without logprobs: true; set "
                "logprobs to true (or leave top_logprobs out)",
                "top_logprobs",
            )
        top = top if asked else None
    elif body.get("logprobs") is False:  # what a chat-minded client sends for none: none
        top = None
    else:
        top = _int(body, "logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not limits.scores:
        raise RequestError(
            "logprobs are not served by this server: its program cannot score tokens (a program "
            "loaded from an artifact holds no scoring stage); serve a compiled program "
            "(--target/--draft) for logprobs",
            "logprobs",
        )
    return top


def sampling_controls(body: dict, limits: Limits):
    """The request's ``top_k``, ``top_p``, ``min_p``, penalties and ``logit_bias`` as checked
    :class:`saguaro.SamplingControls`, or None where they are absent or at their defaults; a value out of range,
    or any control where the program cannot apply them (``limits.controls``), is a 400 naming its field."""
    vocab_size = limits.vocab_size
    from saguaro import ControlError, SamplingControls

    given = {
        f.name: body[f.name]
        for f in fields(SamplingControls)
        if f.name != "grammar" and body.get(f.name) is not None  # the grammar comes of response_format, tools
    }
    try:
        controls = SamplingControls.of(**given)
        controls.check(vocab_size)
    except ControlError as exc:
        raise RequestError(str(exc), exc.field) from None
    except TypeError as exc:  # a value of the wrong type where a number is compared
        raise RequestError(
            f"logit_bias={given.get('logit_bias')!r} is not allowed ({exc}): give an object of token "
            "id to number",
            "logit_bias",
        ) from None
    if controls.active and not limits.controls:
        raise RequestError(f"{next(iter(given))}: {CONTROLS_UNSUPPORTED}", next(iter(given)))
    return controls if controls.active else None


CONTROLS_UNSUPPORTED = (
    "this server's program cannot apply sampling controls or grammars in its speculative rounds (a loaded "
    "artifact has no target.verify_logits stage); leave the field at its default, or serve with --mode ar"
)


def _timeout(body: dict) -> float | None:
    value = body.get("timeout")
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise RequestError(f"timeout={value!r} is not allowed: it must be a number of seconds > 0", "timeout")
    return float(value)


def request_of(body: dict, prompts: list) -> Request:
    """The :class:`Request` of ``prompts`` (one :class:`Sampling` each): ``n`` choices per prompt; with a ``seed``,
    the ``j``-th choice of each prompt samples with ``seed + j`` (mod 2**63), so choice 0 is the request's own."""
    n = _int(body, "n", 1, 1, MAX_N)
    choices = [
        s if j == 0 or s.seed is None else replace(s, seed=(s.seed + j) % SEED_LIMIT)
        for s in prompts
        for j in range(n)
    ]
    first = prompts[0]
    return Request(
        choices, sum(len(s.prompt_ids) for s in prompts), _timeout(body), first.stream, first.include_usage
    )


def _prompt_list(prompt) -> list:
    """``prompt`` as a list of prompts, each a string or a list of token ids; raises for any other shape."""

    def ids(value) -> bool:
        return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)

    if isinstance(prompt, str) or (ids(prompt) and prompt):
        return [prompt]
    if (
        isinstance(prompt, list)
        and prompt
        and (all(isinstance(p, str) for p in prompt) or all(ids(p) for p in prompt))
    ):
        return list(prompt)
    if prompt == []:
        raise RequestError("the prompt is empty: give at least one token of text", "prompt")
    raise RequestError(
        f"prompt of type {type(prompt).__name__} is not allowed: give a string or a list of token ids, "
        "or a non-empty list of prompts (all strings or all token-id lists)",
        "prompt",
    )


def completion_request(
    body: dict, tokenizer, limits: Limits, unknown: UnknownFields | None = None
) -> Request:
    """``/v1/completions``: ``prompt`` is a string, a list of token ids, or a list of either (a batch of prompts)."""
    check_fields(body, "completions", unknown)
    prompts = []
    for prompt in _prompt_list(body.get("prompt")):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise RequestError(
                    "this server has no tokenizer: give the prompt as a list of token ids", "prompt"
                )
            ids, text = list(tokenizer(prompt).input_ids), prompt
        else:
            ids, text = list(prompt), None
        if any(not 0 <= t < limits.vocab_size for t in ids):
            raise RequestError(
                f"prompt holds token ids outside the vocabulary [0, {limits.vocab_size})", "prompt"
            )
        sampling = sampling_fields(body, ids, limits, echo=_bool(body, "echo"))
        sampling.prompt_text = (
            text if text is not None else (tokenizer.decode(ids) if tokenizer is not None else "")
        )
        prompts.append(sampling)
    constrain(prompts, body, tokenizer, limits)
    return request_of(body, prompts)


def constrain(prompts: list, body: dict, tokenizer, limits: Limits, tools=None) -> None:
    """Give each of ``prompts`` (its :class:`Sampling`) the grammar its answer follows, where the request asks for
    one (``response_format``; chat: ``tools``, see :mod:`saguaro.serve.structured`), as a sampling control, and
    the tool choice its answer is parsed by."""
    structured = limits.structured or Structured(tokenizer, limits.vocab_size)
    grammar = grammar_of(body, structured, tools)
    if grammar is None:
        return
    if not limits.controls:
        field = "response_format" if body.get("response_format") is not None else "tools"
        raise RequestError(f"{field}: {CONTROLS_UNSUPPORTED}", field)
    from saguaro import SamplingControls

    for sampling in prompts:
        controls = sampling.controls or SamplingControls()
        sampling.controls = replace(controls, grammar=grammar)
        sampling.tools = tools if tools is not None and tools.constrains else None


def message_for_template(i: int, message) -> dict:
    """``messages[i]`` as the chat template takes it: ``content`` a string (a list of text parts joined with
    newlines, as vLLM joins them; null, where an assistant message carries ``tool_calls``, the empty string);
    every other key (``name``, ``tool_calls``, ``tool_call_id``, ...) passed on as given."""
    if not (isinstance(message, dict) and isinstance(message.get("role"), str)):
        raise RequestError(
            f"messages[{i}] is not allowed: each message is an object with a string role and a "
            "content (a string or a list of text parts)",
            f"messages[{i}]",
        )
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise RequestError(
                    f"messages[{i}].content[{j}] is not allowed: only text parts "
                    f'({{"type": "text", "text": "..."}}) are served; got '
                    f"{'type ' + repr(kind) if kind is not None else repr(part)[:80]}",
                    f"messages[{i}].content",
                )
            texts.append(part["text"])
        content = "\n".join(texts)
    elif content is None and message.get("tool_calls"):
        content = ""
    elif not isinstance(content, str):
        raise RequestError(
            f"messages[{i}].content={content!r} is not allowed: give a string or a list of text "
            "parts (null only in an assistant message with tool_calls)",
            f"messages[{i}].content",
        )
    calls = message.get("tool_calls")
    if isinstance(
        calls, list
    ):  # arguments as the templates read them: an object, not its JSON text (as vLLM)
        message = {**message, "tool_calls": [_call_for_template(c) for c in calls]}
    return {**message, "content": content}


def _call_for_template(call):
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}} if isinstance(arguments, dict) else call


def template_kwargs(body: dict) -> dict:
    """``chat_template_kwargs`` as the template's extra variables (an object; keys of the template call itself,
    :data:`TEMPLATE_CALL_KEYS`, left out); a 400 naming it otherwise."""
    extra = body.get("chat_template_kwargs")
    if extra is None:
        return {}
    if not isinstance(extra, dict) or not all(isinstance(k, str) for k in extra):
        raise RequestError(
            f"chat_template_kwargs={extra!r} is not allowed: give an object of template variables",
            "chat_template_kwargs",
        )
    return {k: v for k, v in extra.items() if k not in TEMPLATE_CALL_KEYS}


def chat_request(body: dict, tokenizer, limits: Limits, unknown: UnknownFields | None = None) -> Request:
    """``/v1/chat/completions``: ``messages`` through the tokenizer's chat template."""
    check_fields(body, "chat", unknown)
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise RequestError(
            "this model's tokenizer has no chat template, so /v1/chat/completions cannot format "
            "messages; use /v1/completions with a prompt",
            "messages",
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects", "messages")
    messages = [message_for_template(i, m) for i, m in enumerate(messages)]
    tools, extra = tool_choice_of(body), template_kwargs(body)
    try:
        ids = tokenizer.apply_chat_template(
            messages,
            tools=tools.tools if tools is not None else None,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            **extra,
        )
    except Exception as exc:
        raise RequestError(f"the chat template could not format these messages: {exc}", "messages") from None
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    prompts = [sampling_fields(body, ids, limits, chat=True)]
    constrain(prompts, body, tokenizer, limits, tools)
    return request_of(body, prompts)
