"""Structured output: a request's ``response_format`` (and, on chat, its tool choice: :mod:`saguaro.serve.tools`) as
the grammar its answer must follow, a ``saguaro.Grammar`` over the program's vocabulary. It is one more sampling
control (``SamplingControls.grammar``), exact under speculation (the target's verification and the draft's
proposals masked alike; mode ``ssd`` runs SD's rounds, its lane cannot carry the grammar: ``usage["saguaro"]
["ran_as"]`` says ``sd``). The grammars of the last :data:`KEPT_GRAMMARS` schemas and grammar texts asked are kept:
requests that ask for the same one get the same ``Grammar`` and share a batch session (each row its own state), as a
client sending one schema with every request does.

``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}`` (one JSON object), ``{"type":
"json_schema", "json_schema": {"name", "schema", "strict"}}`` (one JSON document valid under ``schema``; none given:
any object). A format of another type, or a schema the grammar library refuses (not valid JSON Schema, or
unsatisfiable) is a 400 naming ``response_format``."""

from __future__ import annotations

import collections
import json
import logging
import threading

from saguaro import Grammar, GrammarError
from saguaro.serve.request_error import RequestError
from saguaro.serve.tools import tool_grammar

log = logging.getLogger(__name__)
ANY_OBJECT = {"type": "object"}
KEPT_GRAMMARS = 64  # the last schemas' and grammar texts' grammars kept, so that their requests batch


class Structured:
    """The server's grammars: the tokenizer read over the program's ``vocab_size`` and end-of-sequence ids
    (``eos_ids``), once (:meth:`warm` starts that in the background, at the server's start)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids=None):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.eos_ids = eos_ids if eos_ids is not None else getattr(tokenizer, "eos_token_id", None)
        self._kept: collections.OrderedDict = (
            collections.OrderedDict()
        )  # (kind, text) -> Grammar, newest last
        self._lock = threading.Lock()

    def _kept_or_built(self, key: tuple, build) -> Grammar:
        """The grammar kept under ``key``, else ``build()``'s, kept (the oldest let go past
        :data:`KEPT_GRAMMARS`)."""
        with self._lock:
            grammar = self._kept.get(key)
            if grammar is not None:
                self._kept.move_to_end(key)
                return grammar
        grammar = build()  # outside the lock: a large schema may take a while; two builds of one are harmless
        with self._lock:
            grammar = self._kept.setdefault(key, grammar)
            self._kept.move_to_end(key)
            while len(self._kept) > KEPT_GRAMMARS:
                self._kept.popitem(last=False)
        return grammar

    def warm(self) -> None:
        """Read the tokenizer for grammars on a thread of its own (a request that needs it first waits for it)."""
        if self.tokenizer is None:
            return

        def read():
            try:
                Grammar.vocabulary(self.tokenizer, self.vocab_size, self.eos_ids)
            except Exception:  # the first request that asks for a grammar gets the error
                log.exception("reading the tokenizer for structured output failed")

        threading.Thread(target=read, name="saguaro-serve-grammar", daemon=True).start()

    def _need_tokenizer(self, param: str) -> None:
        if self.tokenizer is None:
            raise RequestError(f"{param} needs the model's tokenizer, which this server does not have", param)

    def json_schema(
        self, schema: dict | None, param: str = "response_format", where: str | None = None
    ) -> Grammar:
        """The grammar of ``schema``; a schema the library refuses is a 400 naming ``param`` (``where``: the
        schema's place in the request, for the message)."""
        self._need_tokenizer(param)
        try:
            key = ("json_schema", json.dumps(schema, sort_keys=True))
            return self._kept_or_built(
                key, lambda: Grammar.json_schema(schema, self.tokenizer, self.vocab_size, self.eos_ids)
            )
        except GrammarError as exc:
            raise RequestError(f"{where or param}: the JSON schema is not allowed: {exc}", param) from None

    def lark(self, text: str, param: str) -> Grammar:
        self._need_tokenizer(param)
        try:
            return self._kept_or_built(
                ("lark", text), lambda: Grammar.lark(text, self.tokenizer, self.vocab_size, self.eos_ids)
            )
        except GrammarError as exc:
            raise RequestError(f"{param}: the grammar could not be built: {exc}", param) from None


def response_schema(body: dict) -> tuple[bool, dict | None]:
    """``(asked, schema)`` of the request's ``response_format``: asked False for none or ``text``; the schema of a
    ``json_schema`` format (``json_object``: any object). Anything else is a 400 naming ``response_format``."""
    fmt = body.get("response_format")
    if fmt is None:
        return False, None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return False, None
    if kind == "json_object":
        return True, ANY_OBJECT
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise RequestError(
                'response_format of type json_schema needs "json_schema": {"name": ..., "schema": {...}}',
                "response_format",
            )
        schema = spec.get("schema", ANY_OBJECT)
        if not isinstance(schema, dict):
            raise RequestError(
                f"response_format.json_schema.schema={schema!r} is not allowed: give a JSON schema object",
                "response_format",
            )
        return True, schema or ANY_OBJECT
    raise RequestError(
        f"response_format={fmt!r} is not allowed: its type is text, json_object or json_schema",
        "response_format",
    )


def grammar_of(body: dict, structured: Structured, tools=None) -> Grammar | None:
    """The grammar a request's answer follows, or None: its tool choice's where that constrains the answer
    (``auto``: the text alternative is the ``response_format``'s JSON where one is asked), else its
    ``response_format``'s."""
    asked, schema = response_schema(body)
    if tools is not None and tools.constrains:
        for i, parameters in enumerate(tools.functions.values()):  # each checked alone, so the error names it
            structured.json_schema(parameters, "tools", f"tools[{i}].function.parameters")
        text = tool_grammar(tools, Grammar.json_options, schema if asked else None)
        return structured.lark(text, "tool_choice" if tools.mode == "named" else "tools")
    return structured.json_schema(schema) if asked else None
