"""The ASGI app (starlette): the OpenAI-compatible routes, the bearer-key check, the body size limit, every
error in OpenAI's shape (:mod:`saguaro.serve.errors`), and the scheduler's start and drain with the app's
lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from saguaro.serve.errors import ServerErrors, error_response, http_error_handlers
from saguaro.serve.metrics import Metrics
from saguaro.serve.requests import (
    MAX_BODY_BYTES,
    Limits,
    RequestError,
    UnknownFields,
    chat_request,
    completion_request,
    parse_json,
)
from saguaro.serve.responses import Reply
from saguaro.serve.scheduler import Scheduler
from saguaro.serve.structured import Structured

log = logging.getLogger(__name__)
OPEN_PATHS = ("/health", "/metrics")  # open without the key unless --auth-health (probes, Prometheus scrapes)


async def read_body(request) -> bytes:
    """The body, refused with 413 as soon as it passes :data:`MAX_BODY_BYTES` (before reading the rest)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise RequestError(
            f"the request body is {declared} bytes; at most {MAX_BODY_BYTES} are allowed", None, 413
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise RequestError(
                f"the request body is over {MAX_BODY_BYTES} bytes, the most allowed", None, 413
            )
        chunks.append(chunk)
    return b"".join(chunks)


class Service:
    """What the routes share: the program's scheduler, its tokenizer, its name, the metrics, the request limits
    (``default_max_tokens``: None, the room the prompt leaves) and the key (``auth_health``: also on
    :data:`OPEN_PATHS`)."""

    def __init__(
        self,
        program,
        tokenizer,
        model: str,
        max_batch: int,
        max_queue: int,
        api_key: str | None = None,
        default_max_tokens: int | None = None,
        auth_health: bool = False,
        k_choice: str = "measured",
    ):
        self.tokenizer, self.model, self.api_key, self.auth_health = tokenizer, model, api_key, auth_health
        self.metrics = Metrics()
        self.scheduler = Scheduler(program, self.metrics, max_batch, max_queue, k_choice)
        self.structured = Structured(tokenizer, program.target.spec.vocab_size, program.eos_token_id)
        self.structured.warm()  # reads the tokenizer for grammars in the background
        self.limits = Limits(
            program.max_length,
            program.target.spec.vocab_size,
            default_max_tokens,
            scores=bool(getattr(program, "can_score", False)),
            controls=bool(getattr(program, "can_control", True)),
            structured=self.structured,
        )
        self.unknown = UnknownFields()
        self.started = time.time()

    def needs_key(self, path: str) -> bool:
        return self.api_key is not None and (self.auth_health or path not in OPEN_PATHS)

    def authorized(self, headers) -> bool:
        if self.api_key is None:
            return True
        given = headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode())

    def error(self, exc: RequestError) -> JSONResponse:
        self.metrics.count_request(exc.status)
        return error_response(exc)

    async def generate(self, request, chat: bool):
        arrived = time.monotonic()
        try:
            body = parse_json(await read_body(request))
            parse = chat_request if chat else completion_request
            asked = parse(body, self.tokenizer, self.limits, self.unknown)
        except RequestError as exc:
            return self.error(exc)
        reply = Reply(asked, self.tokenizer, self.model, chat, asyncio.get_running_loop(), arrived)
        try:
            self.scheduler.submit(*reply.jobs)
        except RequestError as exc:
            return self.error(exc)
        if asked.stream:
            return StreamingResponse(
                self._streamed(reply), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        return await self._whole(request, reply)

    async def _whole(self, request, reply: Reply):
        task = asyncio.ensure_future(reply.whole())
        try:
            while True:  # a client that leaves while its answer is made frees its rows
                done, _ = await asyncio.wait({task}, timeout=0.5)
                if done:
                    break
                if await request.is_disconnected():
                    reply.leave("client disconnected")
                    self.metrics.count_request("cancelled")
                    task.cancel()
                    return PlainTextResponse("", status_code=499)
            body = task.result()
        except RequestError as exc:
            return self.error(exc)
        self._finished(reply)
        return JSONResponse(body)

    async def _streamed(self, reply: Reply):
        complete = False
        try:
            async for line in reply.sse():
                yield line
            complete = True
        finally:
            if not complete:  # the client went away (the response task was cancelled): free the rows
                reply.leave("client disconnected")
                self.metrics.count_request("cancelled")
            elif reply.error is not None:  # ended with an error chunk (a failure, the timeout)
                self.metrics.count_request(reply.error.status)
            else:
                self._finished(reply)

    def _finished(self, reply: Reply) -> None:
        self.metrics.count_request(200)
        usage = reply.usage()
        self.metrics.tokens(usage["prompt_tokens"], usage["completion_tokens"])


def build_app(service: Service) -> Starlette:
    async def completions(request):
        return await service.generate(request, chat=False)

    async def chat_completions(request):
        return await service.generate(request, chat=True)

    async def models(request):
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": service.model,
                        "object": "model",
                        "created": int(service.started),
                        "owned_by": "saguaro",
                    }
                ],
            }
        )

    async def health(request):
        return JSONResponse(
            {
                "status": "ok",
                "queue_depth": service.scheduler.queue_depth,
                "running": service.scheduler.running,
            }
        )

    async def metrics(request):
        text = service.metrics.text(
            service.scheduler.queue_depth, service.scheduler.running, service.scheduler.lane_failures
        )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        service.scheduler.start()
        try:
            yield
        finally:  # uvicorn has stopped accepting and waited for the open responses: end the scheduler
            await asyncio.get_running_loop().run_in_executor(None, service.scheduler.stop)

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models),
            Route("/health", health),
            Route("/metrics", metrics),
        ],
        lifespan=lifespan,
        exception_handlers=http_error_handlers(service.metrics),
        middleware=[Middleware(ServerErrors, metrics=service.metrics), Middleware(KeyCheck, service=service)],
    )


class KeyCheck:
    """ASGI middleware: with an API key, every HTTP request (but to :data:`OPEN_PATHS`, unless ``auth_health``)
    carries ``Authorization: Bearer KEY`` (compared in constant time) or gets 401. Plain ASGI, so streamed
    responses and disconnects pass through untouched."""

    def __init__(self, app, service: Service):
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] == "http"
            and self.service.needs_key(scope.get("path", ""))
            and not self.service.authorized(Headers(scope=scope))
        ):
            response = self.service.error(
                RequestError(
                    "missing or wrong API key: send the header Authorization: Bearer KEY",
                    None,
                    401,
                    "authentication_error",
                )
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
