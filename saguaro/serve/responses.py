"""A request's answer, shaped as OpenAI's: one :class:`Answer` per choice (its text decoded from the tokens its
job is handed; stop strings cut it, ``echo`` puts the prompt first), gathered by a :class:`Reply`, whole (one
JSON body, choices in index order) or as server-sent-event chunks, the choices' chunks interleaved as their
tokens come, each carrying its ``index``, ending with ``data: [DONE]``. ``usage`` counts each prompt's tokens
once and every choice's completion tokens, and carries the request's speculation figures
(``usage["saguaro"]``, :mod:`saguaro.serve.figures`). A choice that asks for logprobs carries them, OpenAI's chat or
legacy completions shape (:mod:`saguaro.serve.logprobs`), whole or a chunk's tokens' in each chunk (a chunk goes
out for new logprobs even where its text is held back); with ``echo`` a streamed completion's prompt text goes out
with the prompt's logprobs, in the first chunk after them. A chat choice with a tool choice that constrains it
(:mod:`saguaro.serve.tools`) is parsed into ``tool_calls`` (``finish_reason`` ``tool_calls`` where it ended with
calls), streamed as OpenAI streams them (:class:`~saguaro.serve.tools.ToolCallStream`).

A request's ``timeout`` counts from its arrival: past it, its jobs leave (their rows are freed at the next
round) and :meth:`Reply.events` raises a 408 :class:`RequestError`: a whole answer is a 408, a stream ends with
an error chunk (``{"error": {..., "code": 408}}``) and ``data: [DONE]``."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from saguaro.serve.figures import combined
from saguaro.serve.logprobs import TokenTexts, chat_logprobs, completion_logprobs
from saguaro.serve.requests import Request, RequestError, Sampling
from saguaro.serve.scheduler import Job
from saguaro.serve.tools import ToolCallStream, parse_tool_calls


class Answer:
    """One choice: its :class:`~saguaro.serve.scheduler.Job` (whose events ``deliver(index, event)`` hands on),
    the text made of its tokens so far, and (logprobs asked) their :class:`~saguaro.serve.logprobs.TokenLogprob`
    s, one per token of ``tokens``, and the prompt's (``echo``)."""

    def __init__(self, sampling: Sampling, index: int, tokenizer, deliver):
        self.index, self.tokenizer = index, tokenizer
        self.job = Job(sampling, lambda event: deliver(index, event))
        self.tokens: list = []  # the completion's tokens (cut after the one that completed a stop string)
        self.text = ""
        self.sent = 0  # characters of text already handed out
        self.finish_reason: str | None = None
        self.logprobs: list = []  # of tokens[i], for each i that has its logprobs yet
        self.prompt_logprobs: list | None = None
        self._pending: list = []  # logprobs that came before their tokens
        self.logprobs_sent = 0  # of logprobs, already in a chunk
        self.prompt_sent = False  # prompt_logprobs in a chunk
        self.offset = 0  # a streamed completion's text_offset so far
        self.tool_stream = ToolCallStream() if sampling.tools is not None else None  # parses tool calls

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

    def _settle(self) -> None:
        """Pair the logprobs that came with the tokens they score (those of tokens cut at a stop string dropped)."""
        room = len(self.tokens) - len(self.logprobs)
        if room > 0:
            self.logprobs += self._pending[:room]
            del self._pending[:room]
        del self.logprobs[len(self.tokens) :]

    def on(self, kind: str, value) -> str:
        """One event of the job; the text that may go out now ('' for none: while unfinished, the characters that
        could begin a stop string and an incomplete character are held back). Raises ``RequestError`` (500) on
        ``error``. Once finished (``finish_reason`` set), later events change nothing."""
        if self.finish_reason is not None:
            return ""
        if kind == "error":
            raise RequestError(value, None, 500, "server_error")
        if kind == "logprobs":  # a Scored: before its tokens (a streamed choice), or after them all
            if value.prompt is not None:
                self.prompt_logprobs = value.prompt
            self._pending += value.tokens
            self._settle()
            return ""
        if kind == "done":
            self.finish_reason = value
        else:
            self._take(value)
            self._settle()
        if self.finish_reason is not None:
            end = len(self.text)
        else:
            held = max((len(s) for s in self.sampling.stop), default=1) - 1  # could begin a stop string
            end = max(len(self.text.rstrip("\ufffd")) - held, self.sent)
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out


class Reply:
    """The answer to one :class:`~saguaro.serve.requests.Request`: its choices' :class:`Answer` s, their events
    read from one queue (filled from the scheduler's thread through ``loop``), within its ``timeout`` from
    ``arrived`` (``time.monotonic()``). ``chat``: chat shapes. ``error``: the :class:`RequestError` it ended with."""

    def __init__(
        self, request: Request, tokenizer, model: str, chat: bool, loop, arrived: float | None = None
    ):
        self.request, self.model, self.chat, self.loop = request, model, chat, loop
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.queue: asyncio.Queue = asyncio.Queue()
        self.answers = [Answer(s, i, tokenizer, self._deliver) for i, s in enumerate(request.choices)]
        arrived = time.monotonic() if arrived is None else arrived
        self.deadline = arrived + request.timeout if request.timeout is not None else None
        self.error: RequestError | None = None
        self.token_texts = TokenTexts(tokenizer)

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
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        cached = max((job.figures.cached_tokens for job in self.jobs), default=0)
        if cached:  # as OpenAI reports a prompt's cached tokens: the most any choice reused
            usage["prompt_tokens_details"] = {"cached_tokens": min(cached, prompt)}
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
        except TimeoutError:
            raise self._timed_out() from None

    def _timed_out(self) -> RequestError:
        return RequestError(
            f"the request ran past its timeout of {self.request.timeout:g} s and was cancelled",
            "timeout",
            408,
            "timeout",
        )

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

    def _choice(
        self, answer: Answer, text: str | None, finish, whole: bool, logprobs: dict | None = None
    ) -> dict:
        if self.chat:
            body = (
                {"message": {"role": "assistant", "content": text}} if whole else {"delta": {"content": text}}
            )
            if whole and answer.sampling.tools is not None:
                content, calls = parse_tool_calls(text)
                body = {"message": {"role": "assistant", "content": content}}
                if calls:
                    body["message"]["tool_calls"] = calls
                    finish = "tool_calls" if finish == "stop" else finish
            return {"index": answer.index, **body, "logprobs": logprobs, "finish_reason": finish}
        return {"index": answer.index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def _whole_logprobs(self, answer: Answer) -> dict | None:
        """A whole answer's logprobs (None: not asked): its tokens', after the prompt's with ``echo``."""
        if answer.sampling.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(answer.logprobs, self.token_texts)
        prompt = (answer.prompt_logprobs or []) if answer.sampling.echo else []
        return completion_logprobs(prompt + answer.logprobs, self.token_texts)[0]

    def _chunk_logprobs(self, answer: Answer) -> tuple[str, dict | None]:
        """What a streamed chunk of ``answer`` carries now: the text that goes before its own (a completion's echoed
        prompt, with the prompt's logprobs) and the logprobs not sent yet (None: not asked, or none new)."""
        if answer.sampling.logprobs is None:
            return "", None
        prefix, entries = "", answer.logprobs[answer.logprobs_sent :]
        answer.logprobs_sent = len(answer.logprobs)
        if answer.prompt_logprobs is not None and not answer.prompt_sent:
            answer.prompt_sent = True
            prefix, entries = answer.sampling.prompt_text, answer.prompt_logprobs + entries
        if not entries:
            return prefix, None
        if self.chat:
            return prefix, chat_logprobs(entries, self.token_texts)
        logprobs, answer.offset = completion_logprobs(entries, self.token_texts, answer.offset)
        return prefix, logprobs

    def _echoes_first(self, answer: Answer) -> bool:
        """Whether a streamed completion's echoed prompt goes out first, alone (without logprobs: else with them)."""
        return not self.chat and answer.sampling.echo and answer.sampling.logprobs is None

    def _object(self, choices: list, whole: bool) -> dict:
        kind = ("chat.completion" if whole else "chat.completion.chunk") if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    async def whole(self) -> dict:
        """The whole answer's body; raises ``RequestError`` (500 on a failure, 408 past the timeout)."""
        async for _ in self.events():
            pass
        choices = [
            self._choice(
                a,
                (a.sampling.prompt_text if a.sampling.echo else "") + a.text,
                a.finish_reason,
                True,
                self._whole_logprobs(a),
            )
            for a in self.answers
        ]
        return {**self._object(choices, True), "usage": self.usage()}

    async def sse(self):
        """The body of a streamed answer: ``data: {chunk}`` lines, the last ``data: [DONE]``."""

        def line(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        for a in self.answers:
            if self.chat:
                yield line(
                    self._object(
                        [
                            {
                                "index": a.index,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                        False,
                    )
                )
            elif self._echoes_first(a):
                yield line(self._object([self._choice(a, a.sampling.prompt_text, None, False)], False))
        try:
            async for answer, text, ended in self.events():
                prefix, logprobs = self._chunk_logprobs(answer)
                if answer.tool_stream is not None:  # content and tool-call deltas of the text released so far
                    deltas = answer.tool_stream.deltas(answer.text[: answer.sent], ended)
                    for i, delta in enumerate(deltas or ([{"content": ""}] if logprobs is not None else [])):
                        chunk = self._choice(answer, None, None, False, logprobs if i == 0 else None)
                        chunk["delta"] = delta
                        yield line(self._object([chunk], False))
                elif text or prefix or logprobs is not None:
                    yield line(
                        self._object([self._choice(answer, prefix + text, None, False, logprobs)], False)
                    )
                if ended:
                    finish = answer.finish_reason
                    if answer.tool_stream is not None and answer.tool_stream.called and finish == "stop":
                        finish = "tool_calls"
                    last = self._object(
                        [self._choice(answer, None if self.chat else "", finish, False)], False
                    )
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
