"""Log-probabilities in a served answer (``logprobs``, ``top_logprobs``): each choice's tokens scored by the target,
and shaped as OpenAI answers them.

Values: :meth:`Program.score <saguaro.runtime.program.Program.score>`, the float32 log-softmax of the target's raw
logits (before the temperature or any sampling control; whatever mode ran, speculation does not change them), run
on the scheduler's thread, the one that owns the program (:mod:`saguaro.serve.scheduler`: ``Job.take``). A choice's
prompt and tokens so far are scored as one sequence: a streamed choice (or one with stop strings, which its reader
may end at any round) each time it is handed tokens, taking the new tokens' values (rescoring the whole sequence
each round: O(n^2) over an answer of n tokens, fine at the lengths served today); any other once, when it is done.

Shapes: chat's ``choices[i].logprobs = {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
"logprob", "bytes"}, ...]}, ...]}`` (``top_logprobs`` the ``top_logprobs`` most likely, most likely first);
completions' legacy ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob, ...}, ...], "text_offset"}``
(each dict the ``logprobs`` most likely and the chosen token, as OpenAI: up to ``logprobs + 1`` entries; with
``echo`` the prompt's tokens first, its first token's logprob and top ``null``, as OpenAI and vLLM answer). A
token's text is ``tokenizer.decode([id])``, its ``bytes`` that text's UTF-8 bytes; ``text_offset`` counts those
texts' characters from the start of the choice's text (the prompt's, with ``echo``), streamed or whole alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20  # most alternatives per token a request may ask for (OpenAI's limit)
FLOOR = -9999.0  # a logprob of -inf goes out as this (JSON has no infinity), as OpenAI and vLLM send it


@dataclass(frozen=True)
class TokenLogprob:
    """One token of a choice: its id, its ``logprob`` (None: nothing precedes it, the prompt's first token) and the
    most likely ``(id, logprob)`` pairs at its place, the most likely first (None with a None ``logprob``)."""

    token: int
    logprob: float | None
    top: tuple | None


@dataclass
class Scored:
    """What a job hands out with ``("logprobs", Scored)``: ``tokens``, one :class:`TokenLogprob` per token handed
    out since the last, in order (those handed out next, or already); ``prompt``, the prompt's (``echo``), or None."""

    tokens: list
    prompt: list | None = None


def token_logprobs(program, ids: list, start: int, top: int) -> list:
    """The :class:`TokenLogprob` of positions ``start..`` of the sequence ``ids`` (a prompt and its tokens), with
    ``top`` alternatives each, scored by ``program`` (``Program.score``: on the thread that owns the program)."""
    out = program.score(torch.tensor([ids], dtype=torch.long), top=top)
    values = out.token_logprobs[0, start:].tolist()  # [n]
    best_ids, best_values = (
        out.top_ids[0, start:].tolist(),
        out.top_logprobs[0, start:].tolist(),
    )  # [n, top] each
    entries = []
    for token, value, best, best_value in zip(ids[start:], values, best_ids, best_values):
        if math.isnan(value):
            entries.append(TokenLogprob(token, None, None))
        else:
            entries.append(TokenLogprob(token, _finite(value), tuple(zip(best, map(_finite, best_value)))))
    return entries


def _finite(value: float) -> float:
    return max(value, FLOOR)


class TokenTexts:
    """Each token id's text, ``tokenizer.decode([id])``, decoded once per answer."""

    def __init__(self, tokenizer):
        self.tokenizer, self.texts = tokenizer, {}

    def __call__(self, token: int) -> str:
        text = self.texts.get(token)
        if text is None:
            text = self.texts[token] = self.tokenizer.decode([token])
        return text


def chat_logprobs(entries: list, text_of: TokenTexts) -> dict:
    """Chat's ``logprobs`` object of ``entries`` (generated tokens: each has a logprob)."""

    def one(token: int, logprob) -> dict:
        text = text_of(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            one(e.token, e.logprob) | {"top_logprobs": [one(t, v) for t, v in e.top or ()]} for e in entries
        ]
    }


def completion_logprobs(entries: list, text_of: TokenTexts, offset: int = 0) -> tuple[dict, int]:
    """Completions' legacy ``logprobs`` object of ``entries``, their ``text_offset`` counted from ``offset``; and the
    offset after them (where a streamed choice's next chunk starts)."""
    tokens, values, tops, offsets = [], [], [], []
    for e in entries:
        text = text_of(e.token)
        tokens.append(text)
        values.append(e.logprob)
        offsets.append(offset)
        offset += len(text)
        if e.top is None:
            tops.append(None)
            continue
        pairs = list(e.top)
        if all(t != e.token for t, _ in pairs):  # the chosen token too, in its place by logprob
            pairs = sorted(pairs + [(e.token, e.logprob)], key=lambda pair: -pair[1])
        best: dict = {}
        for t, v in pairs:
            best.setdefault(text_of(t), v)  # two ids of one text: the likelier one's
        tops.append(best)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset
