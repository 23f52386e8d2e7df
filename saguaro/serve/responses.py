"""A request's answer, shaped as OpenAI's: the text decoded from the tokens the scheduler hands out (stop
strings cut it, ``echo`` puts the prompt first), whole (one JSON body) or as server-sent-event chunks
ending with ``data: [DONE]``; ``usage`` counts the prompt's tokens and the completion's."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from saguaro.serve.requests import RequestError


class Answer:
    """Reads one :class:`~saguaro.serve.scheduler.Job`'s events and keeps its text. ``chat``: chat shapes."""

    def __init__(self, job, tokenizer, model: str, chat: bool):
        self.job, self.tokenizer, self.model, self.chat = job, tokenizer, model, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.tokens: list = []  # the completion's tokens (cut after the one that completed a stop string)
        self.text = ""
        self.sent = 0  # characters of text already streamed
        self.finish_reason: str | None = None
        self.queue: asyncio.Queue = asyncio.Queue()

    def usage(self) -> dict:
        prompt = len(self.job.sampling.prompt_ids)
        return {"prompt_tokens": prompt, "completion_tokens": len(self.tokens),
                "total_tokens": prompt + len(self.tokens)}

    def _decode(self, tokens) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def _take(self, new: list) -> None:
        self.tokens += new
        text = self._decode(self.tokens)
        stops = [(text.find(s), s) for s in self.job.sampling.stop if s in text]
        if stops:
            at = min(stops)[0]
            self.text, self.finish_reason = text[:at], "stop"
            while len(self.tokens) > 1 and any(s in self._decode(self.tokens[:-1]) for s in self.job.sampling.stop):
                self.tokens.pop()  # usage counts the tokens up to the one that completed the stop string
            self.job.leave = "stop string"
        else:
            self.text = text

    async def events(self):
        """``("text", delta)`` as tokens come, then ``("done", finish_reason)``; raises RequestError on a failure."""
        while self.finish_reason is None:
            kind, value = await self.queue.get()
            if kind == "error":
                raise RequestError(value, None, 500, "server_error")
            if kind == "done":
                self.finish_reason = value
                break
            self._take(value)
            held = max((len(s) for s in self.job.sampling.stop), default=1) - 1  # could begin a stop string
            text = self.text if self.finish_reason else self.text.rstrip("\ufffd")
            end = len(text) if self.finish_reason else max(len(text) - held, self.sent)
            if end > self.sent:
                yield ("text", text[self.sent:end])
                self.sent = end
        if len(self.text) > self.sent:
            yield ("text", self.text[self.sent:])
            self.sent = len(self.text)

    def _choice(self, text: str | None, finish, whole: bool) -> dict:
        if self.chat:
            body = {"message": {"role": "assistant", "content": text}} if whole else {"delta": {"content": text}}
            return {"index": 0, **body, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    def _object(self, choices: list, whole: bool) -> dict:
        kind = ("chat.completion" if whole else "chat.completion.chunk") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    async def whole(self) -> dict:
        async for _ in self.events():
            pass
        prefix = self.job.sampling.prompt_text if self.job.sampling.echo else ""
        return {**self._object([self._choice(prefix + self.text, self.finish_reason, True)], True),
                "usage": self.usage()}

    async def sse(self):
        """The body of a streamed answer: ``data: {chunk}`` lines, the last ``data: [DONE]``."""
        def line(obj) -> str:
            return f"data: {json.dumps(obj)}\n\n"

        if self.chat:
            yield line(self._object([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}], False))
        elif self.job.sampling.echo:
            yield line(self._object([self._choice(self.job.sampling.prompt_text, None, False)], False))
        try:
            async for kind, value in self.events():
                yield line(self._object([self._choice(value, None, False)], False))
        except RequestError as exc:
            yield line(exc.body())
            yield "data: [DONE]\n\n"
            return
        last = self._object([self._choice("" if not self.chat else None, self.finish_reason, False)], False)
        if self.chat:
            last["choices"][0]["delta"] = {}
        yield line(last)
        if self.job.sampling.include_usage:
            yield line({**self._object([], False), "usage": self.usage()})
        yield "data: [DONE]\n\n"
