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

logger = logging.getLogger("kvpilot.serve")

ENV_API_KEY = "KVPILOT_API_KEY"
_CHOICES = {
    "preemption_mode": PREEMPTION_MODES,
    "device": DEVICES,
    "dtype": DTYPES,
    "attention_backend": ATTENTION_BACKENDS,
}
_SCALARS = {int: int, float: float, str: str}
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


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
    parser.add_argument("model", metavar="MODEL_DIR", help="local Hugging Face model directory (or hub id)")

    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
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
        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${ENV_API_KEY}; "
        "/health and /metrics stay open)",
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
        help="Jinja chat template (a file or the template itself) replacing the tokenizer's",
    )
    server.add_argument(
        "--generation-config",
        choices=("auto", "vllm"),
        default="auto",
        help="'auto': the model's generation_config.json sets default temperature, top_p, "
        "top_k, min_p, repetition_penalty and max_tokens; 'vllm': built-in defaults "
        "(default: %(default)s)",
    )
    server.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="(default: %(default)s)")
    server.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="'json' writes one JSON object per line (default: %(default)s)",
    )
    server.add_argument("--disable-access-log", action="store_true", help="do not log every HTTP request")
    server.add_argument(
        "--disable-log-stats", action="store_true", help="do not log throughput and cache usage every 10 s"
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


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """The ``EngineArgs`` the parsed flags describe (raises ConfigError)."""
    values = {
        f.name: getattr(ns, f.name) for f in engine_arg_fields() if hasattr(ns, f.name) and f.name != "model"
    }
    return EngineArgs(model=ns.model, **values)


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
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True


# ---------------------------------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM. Exit codes: 0 clean shutdown, 1 start-up failure, 2 bad flags."""
    setup_logging(args.log_level, args.log_format)
    try:
        engine_args = engine_args_from(args)
    except ConfigError as exc:
        logger.error("invalid engine argument: %s", exc)
        return 2
    api_key = args.api_key if args.api_key is not None else os.environ.get(ENV_API_KEY)
    chat_template = _read_chat_template(args.chat_template)
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        logger.error("cannot listen on %s:%d: %s", args.host, args.port, exc)
        return 1
    from kvpilot.engine.server.launch import serve  # torch, transformers, uvicorn: only once flags are good

    try:
        return serve(args, engine_args, api_key or None, chat_template, sock)
    finally:
        sock.close()


def _read_chat_template(value: str | None) -> str | None:
    if value is None or not os.path.isfile(value):
        return value
    with open(value, encoding="utf-8") as fh:
        return fh.read()


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound (not yet listening) socket; uvicorn starts listening once the engine is ready."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock
