"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Status codes: 400 invalid parameters or prompts (``context_length_exceeded`` names the lengths), 401 a
missing or wrong API key, 404 an unknown model or path, 413 a body over the size limit, 503 a full
waiting queue (with ``Retry-After``) or a dead engine loop, 500 anything unexpected.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    """An error the client gets back as ``status`` with an OpenAI-shaped body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or (SERVER_ERROR if status >= 500 else INVALID_REQUEST)
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class ClientDisconnected(Exception):
    """The client went away before the response was ready (its engine requests are aborted)."""


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_supported(feature: str, param: str) -> APIError:
    return APIError(
        400, f"{feature} is not supported by this server", param=param, code="unsupported_parameter"
    )
