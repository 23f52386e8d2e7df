"""The error a request is refused with, in OpenAI's shape (its own module: the request parsers and what they call,
:mod:`saguaro.serve.tools` and :mod:`saguaro.serve.structured`, all raise it)."""

from __future__ import annotations


class RequestError(Exception):
    """A request the server refuses: ``status`` (400, 401, 404, 408, 413, 429, ...), ``message``, the ``param`` at
    fault (OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``) and any ``headers`` the
    answer carries (429: ``Retry-After``)."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}
        }
