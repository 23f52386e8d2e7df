"""Tool calls on ``/v1/chat/completions``: ``tools`` and ``tool_choice`` checked (:func:`tool_choice_of`), the
grammar that constrains the answer (:func:`tool_grammar`), and the answer parsed into OpenAI's ``tool_calls``,
whole (:func:`parse_tool_calls`) or streamed as deltas (:class:`ToolCallStream`).

A tool call is written as Hermes and Qwen write theirs: ``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n
</tool_call>``, calls one after another on new lines. ``tool_choice``:

- ``"required"``: one or more calls (one with ``parallel_tool_calls: false``) to any of the tools, nothing else;
- a named function (``{"type": "function", "function": {"name": ...}}``): one call to it (more with
  ``parallel_tool_calls``), nothing else;
- ``"auto"`` (the default with tools): text that holds no ``<tool_call>``, or text then calls (the text, where a
  ``response_format`` asks for JSON, that JSON instead);
- ``"none"`` (the default without tools): no constraint and no parsing; the template still gets the tools.

Each call's ``arguments`` follow the function's ``parameters`` schema (none: ``{}``); ``name`` is one
of the functions'. In the answer, ``arguments`` is the JSON text the model wrote, and ``id`` is ``call_`` and 24
hex digits."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from saguaro.serve.request_error import RequestError

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's function names (a-z, A-Z, 0-9, _ and -), and dots
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # no parameters: {}
# the head of a call's JSON, as the grammar lays it out (json.dumps' separators), up to its arguments' value
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


@dataclass(frozen=True)
class ToolChoice:
    """A request's checked ``tools`` (``functions``: name -> parameters schema, in order; ``tools``: the list as
    given, for the chat template), ``mode`` (``none``, ``auto``, ``required``, ``named``), the ``named`` function
    and whether calls may come several at once (``parallel``)."""

    tools: list
    functions: dict
    mode: str
    named: str | None = None
    parallel: bool = True

    @property
    def constrains(self) -> bool:
        return self.mode != "none"


def tool_choice_of(body: dict) -> ToolChoice | None:
    """The request's :class:`ToolChoice`, or None without tools (``tool_choice`` then ``none``, or absent). A bad
    value is a 400 naming ``tools``, ``tool_choice`` or ``parallel_tool_calls``."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise RequestError(f"tools={tools!r} is not allowed: give a list of function tools", "tools")
    functions: dict = {}
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(function, dict)
        ):
            raise RequestError(
                f"tools[{i}] is not allowed: each tool is "
                '{"type": "function", "function": {"name": ..., "parameters": {...}}}',
                "tools",
            )
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise RequestError(
                f"tools[{i}].function.name={name!r} is not allowed: 1 to 64 letters, digits, _ . or -",
                "tools",
            )
        if name in functions:
            raise RequestError(f"tools[{i}].function.name={name!r} names a function twice", "tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise RequestError(
                f"tools[{i}].function.parameters={parameters!r} is not allowed: give a JSON schema object",
                "tools",
            )
        functions[name] = parameters if parameters else EMPTY_PARAMETERS
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError(
            f"parallel_tool_calls={parallel!r} is not allowed: it must be true or false",
            "parallel_tool_calls",
        )
    choice = body.get("tool_choice")
    named = None
    if choice is None:
        mode = "auto" if functions else "none"
    elif isinstance(choice, str) and choice in ("none", "auto", "required"):
        mode = choice
    elif isinstance(choice, dict) and choice.get("type", "function") == "function":
        named = (
            (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
        )
        if named is None:
            named = choice.get("name")  # the shape some clients send: {"type": "function", "name": ...}
        if not isinstance(named, str):
            raise RequestError(
                f'tool_choice={choice!r} is not allowed: name a function as {{"type": "function", "function": '
                '{"name": ...}}',
                "tool_choice",
            )
        if named not in functions:
            known = ", ".join(functions) or "none"
            raise RequestError(
                f"tool_choice names the function {named!r}, which is not among the request's tools ({known})",
                "tool_choice",
            )
        mode = "named"
    else:
        raise RequestError(
            f'tool_choice={choice!r} is not allowed: give "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if mode == "required" and not functions:
        raise RequestError(f"tool_choice={choice!r} needs tools: the request gives none", "tool_choice")
    if not functions:
        return None
    return ToolChoice(list(tools), functions, mode, named, True if parallel is None else parallel)


def call_schema(name: str, parameters: dict, options: dict) -> dict:
    """The JSON schema of one call to ``name``: ``{"name": name, "arguments": <parameters>}``, laid out by
    ``options`` (the grammar's JSON layout, as ``x-guidance``)."""
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": options,
    }


def tool_grammar(choice: ToolChoice, options: dict, text_schema: dict | None = None) -> str:
    """The Lark grammar (llguidance's dialect) an answer under ``choice`` must follow: calls as the module says,
    their JSON laid out by ``options``; with ``auto``, the text before any call free (holding no
    ``<tool_call>``), or where ``text_schema`` is given, a JSON document of that schema instead."""
    names = [choice.named] if choice.mode == "named" else list(choice.functions)
    schemas = [call_schema(n, choice.functions[n], options) for n in names]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas, "x-guidance": options}
    lines = [
        "%llguidance {}",
        f'body: "\\n" %json {json.dumps(schema)} "\\n{CALL_CLOSE}"',
        f'more: ("\\n{CALL_OPEN}" body)*' if choice.parallel else 'more: ""',
    ]
    if choice.mode != "auto":
        lines.insert(1, f'start: "{CALL_OPEN}" body more')
    elif text_schema is not None:
        lines.insert(1, f'start: answer | "{CALL_OPEN}" body more')
        lines.append(f"answer: %json {json.dumps({**text_schema, 'x-guidance': options})}")
    else:
        lines.insert(1, "start: TEXT | before_call body more")
        # text that holds no call opening; or the shortest text ending in one (lazy), the call's body after it
        lines.append(r"TEXT: /(.|\n)*/ & ~/(.|\n)*<tool_call>(.|\n)*/")
        lines.append(r"before_call[lazy]: /(.|\n)*<tool_call>/")
    return "\n".join(lines)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def value_end(text: str) -> int | None:
    """Where the JSON value that ``text`` begins with ends (the index after it), or None while it is incomplete
    (an object or array whose brackets are not yet closed; a scalar until what follows it shows)."""
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth <= 0:
                return i + 1 if depth == 0 else i
        elif depth == 0 and ch in ",} \n":
            return i
    return None


def parse_tool_calls(text: str) -> tuple[str | None, list]:
    """An answer's ``(content, tool_calls)``: the text before the first call (None where there is none), and each
    whole call as OpenAI's ``{"id", "type": "function", "function": {"name", "arguments"}}``. Text that holds no
    whole call (an answer cut at ``max_tokens`` inside one) is all content, with no calls."""
    calls, start = [], text.find(CALL_OPEN)
    at = start
    while at != -1:
        head = HEAD.match(text, at + len(CALL_OPEN))
        if head is None:
            break
        end = value_end(text[head.end() :])
        if end is None or text.find(CALL_CLOSE, head.end() + end) == -1:
            break
        arguments = text[head.end() : head.end() + end]
        try:
            json.loads(arguments)
            name = json.loads(f'"{head.group(1)}"')
        except json.JSONDecodeError:
            break
        calls.append(
            {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
        )
        at = text.find(CALL_OPEN, text.find(CALL_CLOSE, head.end() + end))
    if not calls:
        return text, []
    return (text[:start] or None), calls


class ToolCallStream:
    """A streamed answer's text turned into chat deltas as it grows, as OpenAI streams tool calls: the content
    before the first call (the characters that could begin ``<tool_call>`` held back), then per call one delta
    with its ``index``, ``id``, ``type`` and ``function.name`` (``arguments`` empty), then deltas of its
    ``arguments`` text as it is written. :meth:`deltas` takes the text released so far (cumulative)."""

    def __init__(self):
        self.content_sent = 0
        self.calls: list = []  # per call: [id, arguments characters sent]

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def deltas(self, text: str, final: bool) -> list:
        """The deltas (``{"content": ...}`` or ``{"tool_calls": [...]}``) that ``text`` adds to what went out."""
        out = []
        start = text.find(CALL_OPEN)
        content_end = len(text) if start == -1 else start
        if start == -1 and not final:  # hold back what could begin a call
            for n in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
                if CALL_OPEN.startswith(text[-n:]):
                    content_end = len(text) - n
                    break
        if content_end > self.content_sent and not self.calls:
            out.append({"content": text[self.content_sent : content_end]})
            self.content_sent = content_end
        at, index = start, 0
        while at != -1:
            head = HEAD.match(text, at + len(CALL_OPEN))
            if head is None:
                break
            if index == len(self.calls):
                name = json.loads(f'"{head.group(1)}"')
                self.calls.append([new_call_id(), 0])
                out.append(
                    {
                        "tool_calls": [
                            {
                                "index": index,
                                "id": self.calls[index][0],
                                "type": "function",
                                "function": {"name": name, "arguments": ""},
                            }
                        ]
                    }
                )
            rest = text[head.end() :]
            end = value_end(rest)
            written = rest[: end if end is not None else len(rest)]
            if end is None and not rest.startswith(("{", "[")):
                written = ""  # a scalar: sent once whole
            sent = self.calls[index][1]
            if len(written) > sent:
                out.append({"tool_calls": [{"index": index, "function": {"arguments": written[sent:]}}]})
                self.calls[index][1] = len(written)
            if end is None:
                break
            close = text.find(CALL_CLOSE, head.end() + end)
            at = text.find(CALL_OPEN, close) if close != -1 else -1
            index += 1
        return out
