"""The engine's typed errors become HTTP answers at the server's edge, and only they: a request error is a
400, a full queue or a dead loop a 503, and any other exception (a plain ``ValueError`` included) a
logged 500 — never a 400 that would blame the client for a bug."""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest

from kvpilot.engine.errors import (
    ConfigError,
    EngineDeadError,
    InvalidRequestError,
    KVCacheSizeError,
    QueueFullError,
    SamplingParamsError,
    WorkerDiedError,
)
from kvpilot.engine.server.app import build_app
from kvpilot.engine.server.errors import from_exception
from kvpilot.engine.server.serving import ServerState


def test_request_errors_are_400_with_the_engine_message():
    for exc in (
        InvalidRequestError("prompt token ids must be integers in [0, 1024); got [5000]"),
        SamplingParamsError("temperature must be >= 0, got -1"),
    ):
        error = from_exception(exc)
        assert (error.status, error.type, error.param, error.code) == (
            400,
            "invalid_request_error",
            "prompt",
            None,
        )
        assert error.message == str(exc)
        assert error.headers == {}


def test_full_queue_is_503_with_retry_after():
    error = from_exception(QueueFullError(num_waiting=4, max_waiting=4, retry_after_s=2))
    assert (error.status, error.type, error.code) == (503, "server_error", "server_overloaded")
    assert error.headers == {"Retry-After": "2"}
    assert "4 waiting, limit 4" in error.message


@pytest.mark.parametrize("cls", [EngineDeadError, WorkerDiedError])
def test_dead_engine_is_503(cls):
    before = from_exception(cls("the engine loop is not running"))
    assert (before.status, before.type, before.code) == (503, "server_error", "engine_dead")
    assert before.message == "the engine is not running: the engine loop is not running"
    during = from_exception(cls("boom"), while_running=True)
    assert (during.status, during.code) == (503, "engine_dead")
    assert during.message == "the engine loop died while the request ran: boom"
    assert during.body() == {
        "error": {"message": during.message, "type": "server_error", "param": None, "code": "engine_dead"}
    }


@pytest.mark.parametrize(
    "exc",
    [
        ValueError("could not broadcast input array"),
        RuntimeError("CUDA error"),
        KeyError("req-1"),
        ConfigError("block_size must be a power of two"),  # an engine error, but no request's fault
        KVCacheSizeError("no room"),
    ],
)
def test_anything_else_is_500_naming_only_the_type(exc):
    error = from_exception(exc)
    assert (error.status, error.type, error.param, error.code) == (
        500,
        "server_error",
        None,
        "internal_error",
    )
    assert error.message == f"internal server error: {type(exc).__name__}"
    assert str(exc.args[0]) not in error.message  # internals stay in the log


class _RefusingEngine:
    """An engine whose ``add`` raises ``exc``."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc
        self.aborted: list[list[str]] = []

    async def add(self, inputs, stream):
        raise self.exc

    def abort(self, request_ids) -> None:
        self.aborted.append(list(request_ids))


class _Tokenizer:
    chat_template = "{{ messages }}"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1 + ord(c) % 50 for c in text]

    def apply_chat_template(self, conversation, **kwargs) -> str:
        return " ".join(m["content"] for m in conversation)


def _post(exc: BaseException, path: str, body: dict) -> httpx.Response:
    state = ServerState(
        engine=_RefusingEngine(exc),
        tokenizer=_Tokenizer(),
        served_model_names=["m"],
        model_dir="/models/m",
        max_model_len=256,
    )
    transport = httpx.ASGITransport(app=build_app(state), raise_app_exceptions=False)

    async def main() -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.post(path, json=body)

    return asyncio.run(main())


COMPLETION = ("/v1/completions", {"model": "m", "prompt": "hello", "max_tokens": 4})
CHAT = (
    "/v1/chat/completions",
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True},
)


@pytest.mark.parametrize("path, body", [COMPLETION, CHAT])
@pytest.mark.parametrize(
    "exc, status, code, headers",
    [
        (InvalidRequestError("duplicate request id 'x'"), 400, None, {}),
        (
            QueueFullError(num_waiting=1, max_waiting=1, retry_after_s=3),
            503,
            "server_overloaded",
            {"retry-after": "3"},
        ),
        (EngineDeadError("the engine loop was shut down"), 503, "engine_dead", {}),
    ],
)
def test_typed_refusals_through_the_app(path, body, exc, status, code, headers):
    response = _post(exc, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert str(exc) in error["message"]
    for key, value in headers.items():
        assert response.headers[key] == value


@pytest.mark.parametrize("path, body", [COMPLETION, CHAT])
def test_a_plain_value_error_from_the_engine_is_a_logged_500(path, body, caplog):
    with caplog.at_level(logging.ERROR, logger="kvpilot.server"):
        response = _post(ValueError("index 7 is out of bounds"), path, body)
    assert response.status_code == 500, response.text
    assert response.json() == {
        "error": {
            "message": "internal server error: ValueError",
            "type": "server_error",
            "param": None,
            "code": "internal_error",
        }
    }
    logged = [r for r in caplog.records if r.name == "kvpilot.server" and r.exc_info]
    assert logged and "index 7 is out of bounds" in str(logged[0].exc_info[1])


def test_the_server_own_body_checks_stay_400():
    # Rejected before the engine is asked: the refusing engine's error never shows.
    response = _post(
        ValueError("never raised"), "/v1/completions", {"model": "m", "prompt": "", "max_tokens": 4}
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"
