"""Every error the server answers is OpenAI's error object ``{"error": {"message", "type", "param", "code"}}``
with its HTTP status, never Starlette's plain text: :func:`error_response` for a refused request
(:class:`~saguaro.serve.requests.RequestError`: 400, 401, 408, 413, 429 with ``Retry-After``, ...),
:func:`http_error_handlers` for the router's 404 (no such route) and 405 (a known route, a wrong method: with
``Allow``), and :class:`ServerErrors` for an exception nothing handled: 500, its traceback logged, the server
serving on."""

from __future__ import annotations

import json
import logging

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse

from saguaro.serve.requests import RequestError

log = logging.getLogger(__name__)

ROUTES = "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics"


def error_response(exc: RequestError) -> JSONResponse:
    """``exc`` as its JSON answer, with its status and headers."""
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def http_error_handlers(metrics) -> dict:
    """Starlette's ``exception_handlers`` for the router's 404 and 405, counted in ``metrics`` by status."""

    async def not_found(request, exc: HTTPException):
        metrics.count_request(404)
        return error_response(
            RequestError(
                f"no route {request.method} {request.url.path}; this server serves {ROUTES}",
                None,
                404,
                "not_found_error",
            )
        )

    async def wrong_method(request, exc: HTTPException):
        metrics.count_request(405)
        allowed = (exc.headers or {}).get("Allow", "")
        return error_response(
            RequestError(
                f"{request.method} is not allowed on {request.url.path}; use {allowed or 'another method'}",
                None,
                405,
                "invalid_request_error",
                {"Allow": allowed} if allowed else None,
            )
        )

    return {404: not_found, 405: wrong_method}


class ServerErrors:
    """ASGI middleware: an exception no route handled is logged with its traceback and answered 500 (counted in
    ``metrics``); where the response had begun (a stream), a server-sent-event stream gets an error chunk and
    ``data: [DONE]``, any other body simply ends. The server keeps serving."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = {"started": False, "ended": False, "stream": False}

        async def sending(message):
            if message["type"] == "http.response.start":
                state["started"] = True
                kinds = [v for k, v in message.get("headers", []) if k.lower() == b"content-type"]
                state["stream"] = any(b"text/event-stream" in v for v in kinds)
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                state["ended"] = True
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            log.exception("unhandled error answering %s %s", scope.get("method"), scope.get("path"))
            self.metrics.count_request(500)
            error = RequestError(
                f"internal server error: {type(exc).__name__}: {exc}", None, 500, "server_error"
            )
            try:
                if not state["started"]:
                    await error_response(error)(scope, receive, send)
                elif not state["ended"]:
                    tail = f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n" if state["stream"] else ""
                    await send({"type": "http.response.body", "body": tail.encode(), "more_body": False})
            except Exception:
                log.debug("could not answer the unhandled error: the connection is gone", exc_info=True)
