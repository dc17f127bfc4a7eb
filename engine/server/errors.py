"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Status codes: 400 invalid parameters or prompts (``context_length_exceeded`` names the lengths), 401 a
missing or wrong API key, 404 an unknown model or path, 413 a body over the size limit, 503 a full
waiting queue (with ``Retry-After``) or a dead engine loop, 500 anything unexpected.

The engine's typed errors (``kvpilot.engine.errors``) become HTTP answers in one place,
:func:`from_exception`; an exception of any other type is a 500, never a 400.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from kvpilot.engine import metrics_names
from kvpilot.engine.errors import EngineDeadError, InvalidRequestError, QueueFullError

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


def refusal_reason(error: APIError) -> str | None:
    """The ``kvpilot_requests_refused_total`` reason of an answer: a full queue (503), an invalid
    request or bound (400) or an oversized body (413); None for any other answer (not a refusal)."""
    if error.status == 503 and error.code == "server_overloaded":
        return metrics_names.REFUSED_QUEUE_FULL
    if error.status == 413:
        return metrics_names.REFUSED_TOO_LARGE
    if error.status == 400:
        return metrics_names.REFUSED_INVALID
    return None


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def not_supported(feature: str, param: str) -> APIError:
    return APIError(
        400, f"{feature} is not supported by this server", param=param, code="unsupported_parameter"
    )


def from_exception(exc: BaseException, *, while_running: bool = False) -> APIError:
    """The answer to an exception raised below the HTTP layer.

    ``InvalidRequestError`` (``SamplingParamsError`` included): 400 ``invalid_request_error`` with the
    engine's message and the error's ``param`` and ``code``. ``QueueFullError``: 503
    ``server_overloaded`` with ``Retry-After``. ``EngineDeadError`` (``WorkerDiedError`` included): 503
    ``engine_dead``, saying whether the loop was already down when the request came (``while_running``
    False) or died while it ran. Anything else: 500 ``internal_error`` naming only the exception's type;
    the caller logs it.
    """
    if isinstance(exc, InvalidRequestError):
        return bad_request(str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, QueueFullError):
        return APIError(
            503, str(exc), code="server_overloaded", headers={"Retry-After": str(exc.retry_after_s)}
        )
    if isinstance(exc, EngineDeadError):
        when = "the engine loop died while the request ran" if while_running else "the engine is not running"
        return APIError(503, f"{when}: {exc}", code="engine_dead")
    return APIError(500, f"internal server error: {type(exc).__name__}", code="internal_error")
