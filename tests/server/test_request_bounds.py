"""Hostile requests cost a bounded amount: stop strings, stop token ids and prompts x n have documented
limits (server flags, named in the 400), unknown fields are reported at a bounded rate with no state
kept per key, and the API key is normalised on both sides and guards the API's description too.

Through the ASGI app with a stand-in engine that refuses every request with a full queue: a request
that passes the server's checks gets that 503, one that fails them a 400 before the engine is asked.
"""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest

from kvpilot.engine.errors import ConfigError, QueueFullError
from kvpilot.engine.server import protocol
from kvpilot.engine.server.app import build_app
from kvpilot.engine.server.limits import RequestLimits, UnknownFieldsLog
from kvpilot.engine.server.serving import ServerState

from .test_error_mapping import _RefusingEngine, _Tokenizer

KEY = "s3cret-key"


def make_state(**kwargs) -> ServerState:
    engine = _RefusingEngine(QueueFullError(num_waiting=0, max_waiting=0, retry_after_s=1))
    engine.is_healthy = True
    return ServerState(
        engine=engine,
        tokenizer=_Tokenizer(),
        served_model_names=["m"],
        model_dir="/models/m",
        max_model_len=256,
        **kwargs,
    )


def request(state: ServerState, method: str, path: str, **kwargs) -> httpx.Response:
    transport = httpx.ASGITransport(app=build_app(state), raise_app_exceptions=False)

    async def main() -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(main())


def completion(state: ServerState, **fields) -> httpx.Response:
    body = {"model": "m", "prompt": "hello", "max_tokens": 4, **fields}
    return request(state, "POST", "/v1/completions", json=body)


def chat(state: ServerState, **fields) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    return request(state, "POST", "/v1/chat/completions", json=body)


def refused_with(response: httpx.Response, param: str, *words: str) -> str:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    for word in words:
        assert word in error["message"], error
    return error["message"]


def admitted(response: httpx.Response) -> bool:
    """The request passed every server check (the stand-in engine then refused it as overloaded)."""
    return response.status_code == 503 and response.json()["error"]["code"] == "server_overloaded"


def test_default_limits_are_documented_numbers():
    assert RequestLimits() == RequestLimits(
        max_stop_sequences=64,
        max_stop_sequence_length=256,
        max_stop_token_ids=256,
        max_sequences_per_request=256,
    )
    with pytest.raises(ConfigError, match="max_sequences_per_request"):
        RequestLimits(max_sequences_per_request=0)


@pytest.mark.parametrize("send", [completion, chat], ids=["completions", "chat"])
def test_stop_strings_and_ids_are_bounded_at_the_limit(send):
    state = make_state()
    assert admitted(send(state, stop=[f"s{i}" for i in range(64)]))
    refused_with(
        send(state, stop=[f"s{i}" for i in range(65)]), "stop", "65", "at most 64", "--max-stop-sequences"
    )
    assert admitted(send(state, stop="x" * 256))
    refused_with(
        send(state, stop=["ok", "x" * 257]), "stop", "257", "at most 256", "--max-stop-sequence-length"
    )
    assert admitted(send(state, stop_token_ids=[1] * 256))
    refused_with(
        send(state, stop_token_ids=[1] * 257), "stop_token_ids", "257", "at most 256", "--max-stop-token-ids"
    )


def test_limits_follow_the_server_configuration():
    state = make_state(
        limits=RequestLimits(max_stop_sequences=2, max_stop_token_ids=0, max_sequences_per_request=6)
    )
    refused_with(completion(state, stop=["a", "b", "c"]), "stop", "at most 2")
    refused_with(completion(state, stop_token_ids=[1]), "stop_token_ids", "at most 0")
    assert admitted(completion(state, prompt=["a", "b", "c"], n=2))
    message = refused_with(
        completion(state, prompt=["a", "b", "c", "d"], n=2), "prompt", "--max-sequences-per-request"
    )
    assert "4 prompt(s) x n=2 = 8 sequences" in message and "at most 6" in message
    refused_with(chat(state, n=7), "n", "1 prompt(s) x n=7 = 7 sequences")
    assert admitted(chat(state, n=6))


def test_many_prompts_times_n_is_refused_before_the_engine():
    state = make_state()
    message = refused_with(
        completion(state, prompt=["p"] * 2048, n=128), "prompt", "--max-sequences-per-request"
    )
    assert "2048 prompt(s) x n=128 = 262144 sequences" in message
    assert admitted(completion(state, prompt=["p"] * 128, n=2))
    assert state.engine.aborted == []


def test_unknown_fields_log_a_bounded_number_of_lines_and_keep_no_state(caplog, monkeypatch):
    log = UnknownFieldsLog(interval_s=3600.0)
    monkeypatch.setattr(protocol, "unknown_fields_log", log)
    state = make_state()
    hostile = {f"junk_{i}": i for i in range(50_000)}
    with caplog.at_level(logging.WARNING, logger="kvpilot.server"):
        for _ in range(3):
            raw = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 4, **hostile})
            response = request(
                state, "POST", "/v1/completions", content=raw, headers={"content-type": "application/json"}
            )
            assert admitted(response)
        assert admitted(completion(state, another_unknown=1))
    records = [r for r in caplog.records if r.name == "kvpilot.server"]
    assert len(records) == 1, [r.getMessage()[:200] for r in records]
    message = records[0].getMessage()
    assert message.startswith("ignoring 50000 unsupported request field(s): 'junk_0', 'junk_1'")
    assert "and 49995 more" in message and len(message) < 400
    # The warner's whole state: two numbers and its settings, whatever was sent.
    assert {k: v for k, v in vars(log).items() if k != "_lock"} == {
        "interval_s": 3600.0,
        "max_names": 5,
        "_last": log._last,
        "_num_suppressed": 3,
    }
    assert not hasattr(protocol, "_warned_fields")


def test_unknown_fields_warning_returns_after_the_interval(caplog):
    log = UnknownFieldsLog(interval_s=0.0)
    with caplog.at_level(logging.WARNING, logger="kvpilot.server"):
        log.observe({"a": 1})
        log.observe({"b": 1})
        log.observe({})
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "'a'" in messages[0] and "'b'" in messages[1]


def test_api_key_is_normalised_on_both_sides():
    state = make_state(api_key=f" {KEY}\n")  # a key file written with a final newline
    assert state.api_key == KEY
    assert admitted(_with_key(state, f"Bearer {KEY}"))
    assert admitted(_with_key(state, f"Bearer  {KEY} "))
    assert _with_key(state, f"Bearer {KEY}x").status_code == 401
    assert _with_key(state, None).status_code == 401
    for empty in ("", "  ", "\n"):
        with pytest.raises(ConfigError, match="empty"):
            make_state(api_key=empty)


def _with_key(state: ServerState, authorization: str | None) -> httpx.Response:
    headers = {"Authorization": authorization} if authorization else {}
    body = {"model": "m", "prompt": "hello", "max_tokens": 4}
    return request(state, "POST", "/v1/completions", json=body, headers=headers)


def test_openapi_and_docs_need_the_key_health_does_not():
    state = make_state(api_key=KEY)
    for path in ("/openapi.json", "/docs", "/docs/oauth2-redirect"):
        response = request(state, "GET", path)
        assert response.status_code == 401, path
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert request(state, "GET", "/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()["info"]
    assert request(state, "GET", "/docs", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert request(state, "GET", "/health").status_code == 200
    assert request(state, "GET", "/version").status_code == 200
    # Without a key everything is open, the description included.
    assert request(make_state(), "GET", "/openapi.json").status_code == 200
