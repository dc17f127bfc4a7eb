"""Bad requests get the documented status and OpenAI's error shape, and cost the server nothing: no
crashed loop, no leaked KV block."""

from __future__ import annotations

import socket
from urllib.parse import urlparse

import httpx
import openai
import pytest

from .conftest import API_KEY, MAX_MODEL_LEN, MODEL_NAME


def assert_error(
    response: httpx.Response,
    status: int,
    param: str | None = "any",
    code: str | None = "any",
    match: str = "",
) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert list(body) == ["error"]
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    assert isinstance(error["message"], str) and error["message"]
    if param != "any":
        assert error["param"] == param, error
    if code != "any":
        assert error["code"] == code, error
    assert match in error["message"], error
    return error


def completion(**fields) -> dict:
    return {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 4, **fields}


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"n": 0}, "n"),
        ({"n": 100000}, "n"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "16"}, "max_tokens"),
        ({"max_tokens": 4.0}, "max_tokens"),
        ({"logprobs": 50}, "logprobs"),
        ({"presence_penalty": 5.0}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"seed": 2**70}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"logit_bias": {"5": 101.0}}, "logit_bias"),
        ({"suffix": "tail"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"min_tokens": 10, "max_tokens": 4}, "min_tokens"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": [10**6], "min_tokens": 2}, "stop_token_ids"),  # would index past the logits
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"prompt": 12}, "prompt"),
        ({"prompt": [10**7]}, "prompt"),
        ({"prompt": [1, -3]}, "prompt"),
        # The server's per-request bounds (flags; defaults 64 / 256 characters / 256 / 256).
        ({"stop": [f"s{i}" for i in range(65)]}, "stop"),
        ({"stop": "x" * 257}, "stop"),
        ({"stop_token_ids": [1] * 257}, "stop_token_ids"),
        ({"prompt": ["hi"] * 200, "n": 2}, "prompt"),
        ({"prompt": [[1, 2]] * 2048}, "prompt"),
        ({"n": 128, "prompt": ["a", "b", "c"]}, "prompt"),
    ],
)
def test_invalid_completion_parameters_are_400(server, fields, param):
    assert_error(server.post("/v1/completions", json=completion(**fields)), 400, param=param)


@pytest.mark.parametrize(
    "fields, param, code",
    [
        ({"messages": []}, "messages", None),
        ({"messages": "hello"}, "messages", None),
        ({"messages": [{"content": "no role"}]}, "messages", None),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0].type",
            "unsupported_parameter",
        ),
        ({"top_logprobs": 2}, "top_logprobs", None),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", None),
        # tool_choice defaults to "auto" with tools, which this server (no --enable-auto-tool-choice) refuses.
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice", None),
        ({"response_format": {"type": "structural_tag"}}, "response_format", "unsupported_parameter"),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", None),
        ({"max_completion_tokens": MAX_MODEL_LEN}, "max_completion_tokens", "context_length_exceeded"),
    ],
)
def test_invalid_chat_parameters_are_400(server, fields, param, code):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    assert_error(server.post("/v1/chat/completions", json=body), 400, param=param, code=code)


def test_prompt_longer_than_max_model_len_names_the_lengths(server):
    too_long = [5] * (MAX_MODEL_LEN + 52)
    error = assert_error(
        server.post("/v1/completions", json=completion(prompt=too_long)),
        400,
        param="prompt",
        code="context_length_exceeded",
    )
    assert str(MAX_MODEL_LEN) in error["message"] and str(MAX_MODEL_LEN + 52) in error["message"]

    error = assert_error(
        server.post("/v1/completions", json=completion(prompt=[5] * 2000, max_tokens=100)),
        400,
        param="max_tokens",
        code="context_length_exceeded",
    )
    for number in (MAX_MODEL_LEN, 2100, 2000, 100):
        assert str(number) in error["message"]

    # The official client surfaces the same error.
    with pytest.raises(openai.BadRequestError) as err:
        server.client().completions.create(model=MODEL_NAME, prompt="hi", max_tokens=MAX_MODEL_LEN)
    assert err.value.status_code == 400
    assert err.value.response.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    "raw, code, match",
    [
        (b'{"prompt": "x", "max_tokens": 3', "invalid_json", "not valid JSON"),
        (b'{"prompt": "\xff\xfe"}', "invalid_encoding", "not valid UTF-8"),
        (b'{"prompt": "x", "temperature": NaN}', "invalid_json", "NaN"),
        (b'{"prompt": "x", "temperature": Infinity}', "invalid_json", "Infinity"),
        (b'{"prompt": "\\ud800 lone surrogate"}', "invalid_encoding", "surrogate"),
        (b"", None, "empty"),
        (b"[1, 2, 3]", "invalid_json", "JSON object"),
        (b'"just a string"', "invalid_json", "JSON object"),
    ],
)
def test_malformed_bodies_are_400(server, raw, code, match):
    response = server.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert_error(response, 400, code=code, match=match)


def post_oversized(server) -> bytes:
    """A raw socket: announce a 64 MiB body, send a few bytes, and read the answer without uploading
    the rest (the server refuses it unread)."""
    url = urlparse(server.url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {64 << 20}\r\n\r\n".encode()
            + b'{"prompt": "'
        )
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    return reply


def test_oversized_body_is_413_before_it_is_read(server):
    reply = post_oversized(server)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), reply
    assert b'"code":"request_too_large"' in body


def test_unknown_model_is_404(server):
    with pytest.raises(openai.NotFoundError) as err:
        server.client().completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
    assert err.value.status_code == 404
    assert_error(err.value.response, 404, param="model", code="model_not_found", match="gpt-4o")
    chat = server.post(
        "/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]}
    )
    assert_error(chat, 404, param="model", code="model_not_found")


def test_api_key_is_required_on_v1_only(server):
    with pytest.raises(openai.AuthenticationError) as err:
        server.client(api_key="wrong-key").completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
    assert err.value.status_code == 401
    assert_error(err.value.response, 401, code="invalid_api_key", match="Incorrect API key")

    missing = httpx.post(f"{server.url}/v1/completions", json=completion())
    assert_error(missing, 401, code="invalid_api_key", match="Missing API key")
    assert missing.headers["www-authenticate"] == "Bearer"
    for path in ("/v1/models", "/v1/chat/completions"):
        assert httpx.get(f"{server.url}{path}", headers={"Authorization": "Basic abc"}).status_code == 401

    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{server.url}{path}").status_code == 200, path
    # The API's description follows the API's rule.
    for path in ("/openapi.json", "/docs"):
        assert_error(httpx.get(f"{server.url}{path}"), 401, code="invalid_api_key")
        assert httpx.get(f"{server.url}{path}", headers=server.headers()).status_code == 200, path


def test_unknown_paths_and_methods(server):
    assert_error(httpx.get(f"{server.url}/v2/anything", headers=server.headers()), 404, code="not_found")
    assert httpx.get(f"{server.url}/v1/completions", headers=server.headers()).status_code == 405


def test_bad_requests_leaked_nothing(server):
    """Runs after the tests above (file order): the engine is idle, every block is free, and it serves."""
    metrics = server.metrics()
    assert metrics.value("vllm:num_requests_running") == 0
    assert metrics.value("vllm:num_requests_waiting") == 0
    assert metrics.value("vllm:kv_cache_usage_perc") == 0.0
    assert httpx.get(f"{server.url}/health").status_code == 200
    resp = server.client().completions.create(
        model=MODEL_NAME, prompt="still alive", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert resp.usage.completion_tokens == 3
