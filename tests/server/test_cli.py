"""``kvpilot serve``'s flags: generated from EngineArgs, so what the operator renders always parses."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import typing

import pytest

from kvpilot.cli import build_parser
from kvpilot.engine.config import EngineArgs, engine_arg_fields, flag_name, to_cli_args
from kvpilot.engine.errors import ConfigError
from kvpilot.engine.server import protocol
from kvpilot.engine.server.cli import engine_args_from, make_arg_parser

from .conftest import kvpilot_command

KVPILOT = kvpilot_command()


def non_default_values() -> dict:
    """A value different from the default for every engine argument (booleans flipped)."""
    hints = typing.get_type_hints(EngineArgs)
    special = {
        "preemption_mode": "swap",
        "device": "cpu",
        "dtype": "bfloat16",
        "kv_cache_dtype": "float16",
        "attention_backend": "torch",
        "block_size": 32,
        "gpu_memory_utilization": 0.85,
        "tokenizer": "/models/tok",
        "swap_space": 2.5,
    }
    values = {}
    for f in engine_arg_fields():
        if f.name == "model":
            continue
        hint = hints[f.name]
        if f.name in special:
            values[f.name] = special[f.name]
        elif hint is bool:
            values[f.name] = not f.default
        elif int in typing.get_args(hint) or hint is int:
            values[f.name] = (f.default or 0) + 3
        elif float in typing.get_args(hint) or hint is float:
            values[f.name] = (f.default or 0.0) + 0.5
        else:
            raise AssertionError(f"no test value for {f.name}: {hint}")
    return values


def parse(argv: list[str]) -> EngineArgs:
    return engine_args_from(make_arg_parser().parse_args(argv))


def test_to_cli_args_round_trips_through_the_parser():
    values = non_default_values()
    parsed = parse(["/models/m", *to_cli_args(values)])
    assert parsed == EngineArgs(model="/models/m", **values)
    # And the defaults (nothing rendered) parse back to the defaults; booleans both ways.
    assert parse(["/models/m"]) == EngineArgs(model="/models/m")
    flipped = {f.name: not f.default for f in engine_arg_fields() if isinstance(f.default, bool)}
    assert flipped and parse(["/m", *to_cli_args(flipped)]) == EngineArgs(model="/m", **flipped)
    assert parse(["/m", *to_cli_args({k: not v for k, v in flipped.items()})]) == EngineArgs(model="/m")


def test_operator_style_pod_args_parse():
    args = [
        "/mnt/models",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--served-model-name",
        "llama-3.1-8b",
        *to_cli_args(
            {
                "max_num_seqs": 64,
                "gpu_memory_utilization": 0.93,
                "enable_prefix_caching": False,
                "tensor_parallel_size": 2,
            }
        ),
    ]
    ns = build_parser(["serve"]).parse_args(["serve", *args])
    assert (ns.host, ns.port, ns.served_model_name) == ("0.0.0.0", 8000, ["llama-3.1-8b"])
    engine_args = engine_args_from(ns)
    assert (engine_args.max_num_seqs, engine_args.gpu_memory_utilization) == (64, 0.93)
    assert engine_args.enable_prefix_caching is False and engine_args.tensor_parallel_size == 2


def test_every_engine_argument_has_a_flag_and_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser(["serve"]).parse_args(["serve", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for f in engine_arg_fields():
        if f.name != "model":
            assert flag_name(f.name) in text, f.name
    for flag in (
        "--host",
        "--port",
        "--served-model-name",
        "--api-key",
        "--max-waiting-requests",
        "--log-level",
    ):
        assert flag in text
    assert "KVPILOT_API_KEY" in text


def test_flags_are_not_abbreviated():
    with pytest.raises(SystemExit):
        make_arg_parser().parse_args(["/m", "--max-num", "8"])


def test_bad_values_exit_2_before_loading_anything(tmp_path):
    result = subprocess.run(
        [*KVPILOT, "serve", str(tmp_path), "--block-size", "12"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "block_size must be a power of two" in result.stderr
    result = subprocess.run(
        [*KVPILOT, "serve", str(tmp_path), "--preemption-mode", "drop"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_taken_port_fails_fast(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [*KVPILOT, "serve", str(tmp_path), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 1
    # The default host is every IPv4 interface (vllm serve's), which includes the loopback port taken.
    assert f"cannot listen on 0.0.0.0:{port}" in result.stderr


def test_missing_model_dir_is_a_one_line_error(tmp_path):
    result = subprocess.run(
        [*KVPILOT, "serve", str(tmp_path / "nope"), "--port", "0", "--log-format", "json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    errors = [json.loads(line) for line in result.stderr.splitlines() if '"ERROR"' in line]
    assert len(errors) == 1 and "does not exist" in errors[0]["message"]
    assert "Traceback" not in result.stderr


def test_generation_config_defaults_apply_unless_the_request_sets_them(tmp_path):
    from kvpilot.engine.server.launch import generation_defaults

    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 64, "bos_token_id": 1, "top_k": None})
    )
    defaults = generation_defaults(str(tmp_path))
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 64}

    req = protocol.validate(
        protocol.ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "top_p": 0.5}
    )
    max_tokens = protocol.default_max_tokens(req, defaults)
    params = protocol.to_sampling_params(req, max_tokens, None, defaults)
    assert (params.temperature, params.top_p, params.max_tokens) == (0.6, 0.5, 64)
    plain = protocol.to_sampling_params(req, None, None, {})
    assert (plain.temperature, plain.max_tokens) == (1.0, None)
    completion = protocol.validate(protocol.CompletionRequest, {"prompt": "x"})
    assert protocol.default_max_tokens(completion, {}) == 16  # OpenAI's completions default


def test_request_limit_flags_parse_and_are_documented(capsys):
    from kvpilot.engine.server.cli import request_limits_from
    from kvpilot.engine.server.limits import RequestLimits

    ns = make_arg_parser().parse_args(
        ["/m", "--max-stop-sequences", "4", "--max-stop-sequence-length", "32", "--max-stop-token-ids", "8"]
        + ["--max-sequences-per-request", "16"]
    )
    assert request_limits_from(ns) == RequestLimits(4, 32, 8, 16)
    assert request_limits_from(make_arg_parser().parse_args(["/m"])) == RequestLimits()
    with pytest.raises(SystemExit):
        make_arg_parser().parse_args(["/m", "--max-sequences-per-request", "0"])
    with pytest.raises(SystemExit):
        build_parser(["serve"]).parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag, default in (
        ("--max-stop-sequences N", 64),
        ("--max-stop-sequence-length CHARS", 256),
        ("--max-stop-token-ids N", 256),
        ("--max-sequences-per-request N", 256),
    ):
        assert flag in text and f"(default: {default})" in text.rsplit(flag, 1)[1][:200], (
            flag
        )  # help, not usage


def test_api_key_resolution():
    from kvpilot.engine.server.startup_inputs import resolve_api_key

    assert resolve_api_key(None, None) is None
    assert resolve_api_key("key\n", None) == "key"  # kubectl create secret --from-file keeps the newline
    assert resolve_api_key(None, "  key \r\n") == "key"
    assert resolve_api_key("flag", "env") == "flag"
    for flag, env, source in (
        ("", None, "--api-key"),
        (" \n", "env", "--api-key"),
        (None, "", "$KVPILOT_API_KEY"),
    ):
        with pytest.raises(ConfigError, match=f"the API key from {re.escape(source)} is empty"):
            resolve_api_key(flag, env)


@pytest.mark.parametrize(
    "argv, env",
    [(["--api-key", ""], {}), ([], {"KVPILOT_API_KEY": ""}), (["--api-key", "\n"], {"KVPILOT_API_KEY": "k"})],
    ids=["empty-flag", "empty-env", "blank-flag"],
)
def test_an_empty_api_key_refuses_to_start(tmp_path, argv, env):
    result = subprocess.run(
        [*KVPILOT, "serve", str(tmp_path), "--port", "0", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )
    assert result.returncode == 2, result.stderr
    assert "API key" in result.stderr and "is empty" in result.stderr
    assert "Traceback" not in result.stderr and "listening" not in result.stderr


def test_chat_template_paths_must_exist(tmp_path):
    from kvpilot.engine.server.startup_inputs import looks_like_path, read_chat_template

    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert read_chat_template(str(template)) == template.read_text()
    inline = "{{ messages[0].content }}/"
    assert read_chat_template(inline) == inline  # Jinja markers: a template, whatever else it holds
    assert read_chat_template("plain words") == "plain words"
    assert read_chat_template(None) is None
    for missing in (str(tmp_path / "nope.jinja"), "templates/chat", "chat.j2", "chat.TXT"):
        assert looks_like_path(missing)
        with pytest.raises(ConfigError, match="no such file"):
            read_chat_template(missing)
    (tmp_path / "empty.jinja").write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        read_chat_template(str(tmp_path / "empty.jinja"))

    result = subprocess.run(
        [*KVPILOT, "serve", str(tmp_path), "--port", "0", "--chat-template", str(tmp_path / "missing.jinja")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "missing.jinja" in errors[0] and "no such file" in errors[0]


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_the_server_socket_turns_nagle_off_on_its_connections(host):
    """asyncio sets TCP_NODELAY only on connections of a socket whose protocol says TCP. Without it a
    response sent in two writes over a kept-alive connection (a stream's headers, then its first
    token) waits for the client's delayed ACK."""
    import asyncio

    from kvpilot.engine.server.cli import bind_socket

    try:
        sock = bind_socket(host, 0)
    except OSError as exc:  # no IPv6 on this host
        pytest.skip(f"cannot bind {host}: {exc}")
    assert sock.proto == socket.IPPROTO_TCP

    async def accepted_nodelay() -> int:
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                conn = transport.get_extra_info("socket")
                seen.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        port = sock.getsockname()[1]
        _, writer = await asyncio.open_connection(host, port)
        try:
            return await asyncio.wait_for(seen, 10)
        finally:
            writer.close()
            server.close()
            await server.wait_closed()

    assert asyncio.run(accepted_nodelay()) != 0
