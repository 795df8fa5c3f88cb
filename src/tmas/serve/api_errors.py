"""Errors the proxy answers with, in the OpenAI error format (``{"error": {message, type, param, code}}``)."""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

# The OpenAI "type" that goes with each status code we answer with.
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    424: "upstream_error",
    429: "requests",
    500: "server_error",
    502: "upstream_error",
    503: "server_error",
}


class ApiError(Exception):
    """A request that gets an error reply: ``status`` is the HTTP code, ``code`` OpenAI's short error code."""

    def __init__(
        self, status: int, message: str, code: str, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        # Reply headers that go with the error (Retry-After on a 429).
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        return JSONResponse(self.body(), status_code=self.status, headers={**headers, **self.headers})
