"""A request's answer, shaped as OpenAI's: one :class:`Answer` per choice (its text decoded from the tokens its
job is handed; stop strings cut it, ``echo`` puts the prompt first), gathered by a :class:`Reply`, whole (one
JSON body, choices in index order) or as server-sent-event chunks, the choices' chunks interleaved as their
tokens come, each carrying its ``index``, ending with ``data: [DONE]``. ``usage`` counts each prompt's tokens
once and every choice's completion tokens, and carries the request's speculation figures
(``usage["saguaro"]``, :mod:`saguaro.serve.figures`).

A request's ``timeout`` counts from its arrival: past it, its jobs leave (their rows are freed at the next
round) and :meth:`Reply.events` raises a 408 :class:`RequestError`: a whole answer is a 408, a stream ends with
an error chunk (``{"error": {..., "code": 408}}``) and ``data: [DONE]``."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from saguaro.serve.figures import combined
from saguaro.serve.requests import Request, RequestError, Sampling
from saguaro.serve.scheduler import Job


class Answer:
    """One choice: its :class:`~saguaro.serve.scheduler.Job` (whose events ``deliver(index, event)`` hands on)
    and the text made of its tokens so far."""

    def __init__(self, sampling: Sampling, index: int, tokenizer, deliver):
        self.index, self.tokenizer = index, tokenizer
        self.job = Job(sampling, lambda event: deliver(index, event))
        self.tokens: list = []  # the completion's tokens (cut after the one that completed a stop string)
        self.text = ""
        self.sent = 0  # characters of text already handed out
        self.finish_reason: str | None = None

    @property
    def sampling(self) -> Sampling:
        return self.job.sampling

    def _decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _take(self, new: list) -> None:
        self.tokens += new
        text = self._decode(self.tokens)
        stop = self.sampling.stop
        stops = [(text.find(s), s) for s in stop if s in text]
        if stops:
            at = min(stops)[0]
            self.text, self.finish_reason = text[:at], "stop"
            while len(self.tokens) > 1 and any(s in self._decode(self.tokens[:-1]) for s in stop):
                self.tokens.pop()  # usage counts the tokens up to the one that completed the stop string
            self.job.leave = "stop string"
        else:
            self.text = text

    def on(self, kind: str, value) -> str:
        """One event of the job; the text that may go out now ('' for none: while unfinished, the characters that
        could begin a stop string and an incomplete character are held back). Raises ``RequestError`` (500) on
        ``error``. Once finished (``finish_reason`` set), later events change nothing."""
        if self.finish_reason is not None:
            return ""
        if kind == "error":
            raise RequestError(value, None, 500, "server_error")
        if kind == "done":
            self.finish_reason = value
        else:
            self._take(value)
        if self.finish_reason is not None:
            end = len(self.text)
        else:
            held = max((len(s) for s in self.sampling.stop), default=1) - 1  # could begin a stop string
            end = max(len(self.text.rstrip("\ufffd")) - held, self.sent)
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out


class Reply:
    """The answer to one :class:`~saguaro.serve.requests.Request`: its choices' :class:`Answer` s, their events
    read from one queue (filled from the scheduler's thread through ``loop``), within its ``timeout`` from
    ``arrived`` (``time.monotonic()``). ``chat``: chat shapes. ``error``: the :class:`RequestError` it ended with."""

    def __init__(self, request: Request, tokenizer, model: str, chat: bool, loop, arrived: float | None = None):
        self.request, self.model, self.chat, self.loop = request, model, chat, loop
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.queue: asyncio.Queue = asyncio.Queue()
        self.answers = [Answer(s, i, tokenizer, self._deliver) for i, s in enumerate(request.choices)]
        arrived = time.monotonic() if arrived is None else arrived
        self.deadline = arrived + request.timeout if request.timeout is not None else None
        self.error: RequestError | None = None

    @property
    def jobs(self) -> list:
        return [a.job for a in self.answers]

    def _deliver(self, index: int, event) -> None:  # on the scheduler's thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))

    def leave(self, reason: str) -> None:
        """Every choice still decoding leaves (its row freed at the next round, or dropped from the queue)."""
        for job in self.jobs:
            job.leave = job.leave or reason

    def usage(self) -> dict:
        prompt, completion = self.request.prompt_tokens, sum(len(a.tokens) for a in self.answers)
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        figures = combined([job.figures for job in self.jobs])
        return usage | ({"saguaro": figures} if figures else {})

    async def _next(self):
        """The next ``(index, event)``; raises the 408 once the deadline has passed."""
        if self.deadline is not None and time.monotonic() >= self.deadline:
            raise self._timed_out()
        if not self.queue.empty():
            return self.queue.get_nowait()
        if self.deadline is None:
            return await self.queue.get()
        try:
            return await asyncio.wait_for(self.queue.get(), self.deadline - time.monotonic())
        except asyncio.TimeoutError:
            raise self._timed_out() from None

    def _timed_out(self) -> RequestError:
        return RequestError(f"the request ran past its timeout of {self.request.timeout:g} s and was cancelled",
                            "timeout", 408, "timeout")

    async def events(self):
        """``(answer, text, ended)`` as the choices' tokens come (``ended``: that choice has just finished), until
        every choice has finished. On a failure or the timeout the other choices leave and ``RequestError`` is
        raised (also kept as ``error``)."""
        try:
            while any(a.finish_reason is None for a in self.answers):
                index, (kind, value) = await self._next()
                answer = self.answers[index]
                if answer.finish_reason is not None:
                    continue
                text = answer.on(kind, value)
                yield answer, text, answer.finish_reason is not None
        except RequestError as exc:
            self.error = exc
            self.leave("timeout" if exc.status == 408 else "request failed")
            raise

    def _choice(self, answer: Answer, text: str | None, finish, whole: bool) -> dict:
        if self.chat:
            body = {"message": {"role": "assistant", "content": text}} if whole else {"delta": {"content": text}}
            return {"index": answer.index, **body, "logprobs": None, "finish_reason": finish}
        return {"index": answer.index, "text": text, "logprobs": None, "finish_reason": finish}

    def _object(self, choices: list, whole: bool) -> dict:
        kind = ("chat.completion" if whole else "chat.completion.chunk") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    async def whole(self) -> dict:
        """The whole answer's body; raises ``RequestError`` (500 on a failure, 408 past the timeout)."""
        async for _ in self.events():
            pass
        choices = [self._choice(a, (a.sampling.prompt_text if a.sampling.echo else "") + a.text, a.finish_reason,
                                True) for a in self.answers]
        return {**self._object(choices, True), "usage": self.usage()}

    async def sse(self):
        """The body of a streamed answer: ``data: {chunk}`` lines, the last ``data: [DONE]``."""
        def line(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        for a in self.answers:
            if self.chat:
                yield line(self._object([{"index": a.index, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}], False))
            elif a.sampling.echo:
                yield line(self._object([self._choice(a, a.sampling.prompt_text, None, False)], False))
        try:
            async for answer, text, ended in self.events():
                if text:
                    yield line(self._object([self._choice(answer, text, None, False)], False))
                if ended:
                    last = self._object([self._choice(answer, None if self.chat else "", answer.finish_reason,
                                                      False)], False)
                    if self.chat:
                        last["choices"][0]["delta"] = {}
                    yield line(last)
        except RequestError as exc:
            yield line(exc.body())
            yield "data: [DONE]\n\n"
            return
        if self.request.include_usage:
            yield line({**self._object([], False), "usage": self.usage()})
        yield "data: [DONE]\n\n"
