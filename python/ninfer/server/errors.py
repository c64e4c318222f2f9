"""API errors and their two wire shapes.

Every failure a client can cause ends as an `ApiError` (status, message, the field at fault), and
the app turns it into the error body of the API the client speaks (docs/api.md, "Errors"):

    OpenAI:    {"error": {"message", "type", "param", "code"}}
    Anthropic: {"type": "error", "error": {"type", "message"}}

Keeping one exception type and two renderers means a check written once (say, a malformed field)
answers correctly on both APIs.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

__all__ = [
    "ApiError",
    "anthropic_body",
    "bad_request",
    "error_response",
    "openai_body",
]

# HTTP status -> (OpenAI error type, Anthropic error type).
_TYPES: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    403: ("permission_error", "permission_error"),
    404: ("not_found_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    415: ("invalid_request_error", "invalid_request_error"),
    429: ("rate_limit_error", "rate_limit_error"),
    500: ("server_error", "api_error"),
    503: ("server_error", "overloaded_error"),
}


class ApiError(Exception):
    """A request the server will not or cannot serve; rendered in the client's API shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def _types(self) -> tuple[str, str]:
        if self.status in _TYPES:
            return _TYPES[self.status]
        return _TYPES[500] if self.status >= 500 else _TYPES[400]


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def openai_body(err: ApiError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err._types()[0], "param": err.param, "code": err.code}}


def anthropic_body(err: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": err._types()[1], "message": err.message}}


def error_response(err: ApiError, anthropic: bool) -> web.Response:
    body = anthropic_body(err) if anthropic else openai_body(err)
    return web.Response(
        status=err.status,
        text=json.dumps(body, ensure_ascii=False),
        content_type="application/json",
        headers=err.headers,
    )
