"""``kvpilot serve MODEL_DIR [flags]``: the OpenAI-compatible server.

The engine flags are generated from ``EngineArgs`` (``engine_arg_fields()``): one flag per field,
``--kebab-case``, booleans as ``--flag`` / ``--no-flag``. That is the contract ``to_cli_args`` renders
for the operator, so whatever it renders parses here. Server flags follow ``vllm serve``.

Start-up order: parse and validate every flag, bind the listening socket (a taken port fails in
milliseconds, not after the model load), load the engine, then serve. Nothing accepts connections
until the engine is ready, so probes see "refused" rather than a hang while the model loads.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import typing
from typing import Any

from kvpilot.engine.config import (
    ATTENTION_BACKENDS,
    DEVICES,
    DTYPES,
    PREEMPTION_MODES,
    EngineArgs,
    engine_arg_fields,
    flag_name,
)
from kvpilot.engine.errors import ConfigError
from kvpilot.engine.server.limits import RequestLimits
from kvpilot.engine.server.startup_inputs import (
    ENV_API_KEY,
    ENV_VLLM_API_KEY,
    read_chat_template,
    resolve_api_key,
)
from kvpilot.engine.server.tool_parsers import PARSERS as TOOL_CALL_PARSERS

logger = logging.getLogger("kvpilot.serve")

# All IPv4 interfaces: what ``vllm serve`` binds when ``--host`` is not given (it binds ``""``).
DEFAULT_HOST = "0.0.0.0"
_CHOICES = {
    "preemption_mode": PREEMPTION_MODES,
    "device": DEVICES,
    "dtype": DTYPES,
    "attention_backend": ATTENTION_BACKENDS,
}
_SCALARS = {int: int, float: float, str: str}
# uvicorn's levels, as ``vllm serve --uvicorn-log-level`` takes them; "trace" is uvicorn's level 5.
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
_TRACE = 5
# The per-request bounds (``RequestLimits`` fields): metavar and what the bound counts.
_LIMIT_FLAGS = {
    "max_stop_sequences": ("N", "most 'stop' strings one request may carry"),
    "max_stop_sequence_length": ("CHARS", "longest 'stop' string, in characters"),
    "max_stop_token_ids": ("N", "most 'stop_token_ids' one request may carry"),
    "max_sequences_per_request": ("N", "most sequences (prompts x n) one request may ask for"),
}


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``serve`` on the top-level ``kvpilot`` command."""
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a Hugging Face model directory over an OpenAI-compatible HTTP API "
        "(/v1/completions, /v1/chat/completions, /v1/models) with /health, /metrics and /version.",
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Example:\n  kvpilot serve /models/llama-3.1-8b --served-model-name llama-3.1-8b "
        "--max-num-seqs 128 --api-key $KEY",
    )
    make_arg_parser(parser)
    parser.set_defaults(func=run)
    return parser


def make_arg_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add the positional model, the server flags and one flag per engine argument to ``parser``."""
    parser = parser or argparse.ArgumentParser(prog="kvpilot serve", allow_abbrev=False)
    parser.add_argument(
        "model",
        metavar="MODEL_DIR",
        nargs="?",
        default=None,
        help="local Hugging Face model directory (or hub id); or give it as --model",
    )

    server = parser.add_argument_group("server")
    server.add_argument(
        "--model",
        dest="model_flag",
        default=None,
        metavar="MODEL_DIR",
        help="the model, as vllm serve takes it; the same as the positional MODEL_DIR",
    )
    server.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help="address to listen on; the default is every IPv4 interface, as vllm serve's, so set "
        "--api-key or bind 127.0.0.1 where the network is not trusted (default: %(default)s)",
    )
    server.add_argument(
        "--port",
        type=_port,
        default=8000,
        help="port to listen on; 0 picks a free one (default: %(default)s)",
    )
    server.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="model name(s) clients may request; the first is reported in responses and "
        "metrics (default: MODEL_DIR)",
    )
    server.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on /v1/*, /openapi.json and /docs (default: "
        f"${ENV_API_KEY}, else ${ENV_VLLM_API_KEY}; /health and /metrics stay open). Surrounding "
        "whitespace is ignored (a key file's final newline); an empty key is an error",
    )
    server.add_argument(
        "--max-waiting-requests",
        type=_non_negative,
        default=None,
        metavar="N",
        help="answer 503 with Retry-After while N sequences are already waiting (default: no limit)",
    )
    server.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE_OR_TEMPLATE",
        help="Jinja chat template replacing the tokenizer's: a file, or the template itself. A value "
        "with no '{{' or '{%%' that contains a path separator or ends in .jinja, .j2 or .txt is a "
        "file, which must exist",
    )
    server.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="serve tool calls (tool_choice 'auto', the default when a request has tools, 'required' or "
        "a named function): the output is read into tool_calls by --tool-call-parser, which it "
        "requires. Without it, as with vllm serve, any tool_choice but 'none' is a 400",
    )
    server.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_CALL_PARSERS),
        default=None,
        help="the model's tool-call format, as vllm serve names it: 'hermes' (Hermes, Qwen: "
        "<tool_call>{...}</tool_call>) or 'llama3_json' (Llama 3 JSON calls)",
    )
    server.add_argument(
        "--live-config-file",
        default=None,
        metavar="PATH",
        help="a JSON object of run-time settings (as POST /admin/config takes them) applied once the "
        "engine is built, before /health answers 200: the values an operator changed at run time. A "
        "missing file changes nothing; an invalid one fails start-up",
    )
    defaults = RequestLimits()
    for name, (metavar, what) in _LIMIT_FLAGS.items():
        server.add_argument(
            flag_name(name),
            type=positive_int if name == "max_sequences_per_request" else _non_negative,
            default=getattr(defaults, name),
            metavar=metavar,
            help=f"{what}; more is a 400 naming this flag (default: %(default)s)",
        )
    server.add_argument(
        "--generation-config",
        choices=("auto", "vllm"),
        default="auto",
        help="'auto': the model's generation_config.json sets default temperature, top_p, "
        "top_k, min_p, repetition_penalty and max_tokens; 'vllm': built-in defaults "
        "(default: %(default)s)",
    )
    server.add_argument(
        "--log-level",
        "--uvicorn-log-level",
        dest="log_level",
        type=str.lower,  # vLLM's scripts write INFO as often as info
        choices=LOG_LEVELS,
        default="info",
        help="(default: %(default)s)",
    )
    server.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="'json' writes one JSON object per line (default: %(default)s)",
    )
    server.add_argument(
        "--disable-access-log",
        "--disable-uvicorn-access-log",
        dest="disable_access_log",
        action="store_true",
        help="do not log every HTTP request",
    )
    server.add_argument(
        "--disable-log-stats", action="store_true", help="do not log throughput and cache usage every 10 s"
    )
    server.add_argument(
        "--request-trace",
        metavar="FILE",
        default=None,
        help="append one JSON line per finished request to FILE: arrival time, prompt and output "
        "lengths, finish reason, TTFT, latency, preemptions; no text (for kvpilot plan --trace)",
    )

    engine = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineArgs)
    for f in engine_arg_fields():
        if f.metadata.get("cli", True) is False:
            continue
        kind = _field_kind(hints[f.name])
        help_text = f.metadata.get("help", "")
        if kind is bool:
            engine.add_argument(
                flag_name(f.name),
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=f.default,
                help=f"{help_text} (default: {'on' if f.default else 'off'})",
            )
            continue
        choices = f.metadata.get("choices", _CHOICES.get(f.name))
        engine.add_argument(
            flag_name(f.name),
            dest=f.name,
            type=_SCALARS[kind],
            default=f.default,
            choices=choices,
            metavar=None if choices else f.name.upper(),
            help=help_text if f.default is None else f"{help_text} (default: %(default)s)",
        )
    return parser


def _field_kind(hint: Any) -> type:
    """The scalar type a flag parses: ``int | None`` -> int, ``bool`` -> bool."""
    args = typing.get_args(hint)
    if args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"engine argument type {hint} has no CLI mapping")
        hint = rest[0]
    if hint is not bool and hint not in _SCALARS:
        raise TypeError(f"engine argument type {hint} has no CLI mapping")
    return hint


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {value}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1 (argparse's usage error otherwise)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def resolve_model(positional: str | None, flag: str | None) -> str:
    """The model to serve: the positional ``MODEL_DIR`` or ``--model`` (vllm serve takes both).
    ConfigError when neither is given, or both are and differ."""
    if positional is not None and flag is not None and positional != flag:
        raise ConfigError(
            f"the model is given twice and the two differ: MODEL_DIR {positional!r} and --model "
            f"{flag!r}; give one of them"
        )
    model = positional if positional is not None else flag
    if model is None:
        raise ConfigError("no model given: pass MODEL_DIR or --model MODEL_DIR")
    return model


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """The ``EngineArgs`` the parsed flags describe (raises ConfigError)."""
    values = {
        f.name: getattr(ns, f.name) for f in engine_arg_fields() if hasattr(ns, f.name) and f.name != "model"
    }
    return EngineArgs(model=resolve_model(ns.model, getattr(ns, "model_flag", None)), **values)


# ---------------------------------------------------------------------------------------------- logging
class _Formatter(logging.Formatter):
    """Text: ``2025-01-01 12:00:00 INFO kvpilot.serve: msg key=value ...``; JSON: one object per line.
    Structured fields come from ``extra={"fields": {...}}``."""

    def __init__(self, as_json: bool) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S")
        self.as_json = as_json

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None) or {}
        if not self.as_json:
            text = super().format(record)
            if fields:
                text += " " + " ".join(f"{k}={v}" for k, v in fields.items())
            return text
        entry = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **fields,
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(fmt == "json"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(_TRACE if level == "trace" else level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True


# ---------------------------------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM. Exit codes: 1 start-up failure, 2 bad flags; after a signal, the
    graceful shutdown ends with the signal re-raised (uvicorn does so: exit -15 after SIGTERM)."""
    setup_logging(args.log_level, args.log_format)
    try:
        args.model = resolve_model(args.model, args.model_flag)
    except ConfigError as exc:
        logger.error("%s", exc)
        return 2
    try:
        engine_args = engine_args_from(args)
    except ConfigError as exc:
        logger.error("invalid engine argument: %s", exc)
        return 2
    try:
        api_key = resolve_api_key(args.api_key, os.environ.get(ENV_API_KEY), os.environ.get(ENV_VLLM_API_KEY))
        chat_template = read_chat_template(args.chat_template)
        check_tool_flags(args.enable_auto_tool_choice, args.tool_call_parser)
    except ConfigError as exc:
        logger.error("%s", exc)
        return 2
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", args.host, args.port, exc)
        return 1
    from kvpilot.engine.server.launch import serve  # torch, transformers, uvicorn: only once flags are good

    try:
        return serve(args, engine_args, api_key, chat_template, sock)
    finally:
        sock.close()


def check_tool_flags(enable_auto_tool_choice: bool, tool_call_parser: str | None) -> None:
    """ConfigError when ``--enable-auto-tool-choice`` comes without ``--tool-call-parser`` (as vllm
    serve refuses it): the server could not tell a call from text."""
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ConfigError(
            "--enable-auto-tool-choice requires --tool-call-parser (one of: "
            f"{', '.join(sorted(TOOL_CALL_PARSERS))})"
        )


def request_limits_from(ns: argparse.Namespace) -> RequestLimits:
    """The ``RequestLimits`` the parsed flags describe."""
    return RequestLimits(**{name: getattr(ns, name) for name in _LIMIT_FLAGS})


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound (not yet listening) socket; uvicorn starts listening once the engine is ready.

    Made with its protocol named (``IPPROTO_TCP``, not 0): asyncio turns Nagle's algorithm off
    (``TCP_NODELAY``) only on connections of a socket whose protocol says TCP. With it on, a response
    written in more than one send over a kept-alive connection (a stream's first token after its
    headers, a /metrics body of a few segments) waits for the client's delayed ACK: 40 ms on Linux."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock
