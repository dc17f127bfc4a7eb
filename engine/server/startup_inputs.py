"""What ``kvpilot serve`` reads at start-up beyond its flags: the API key (``--api-key``, else
``$KVPILOT_API_KEY``, else vLLM's ``$VLLM_API_KEY``), the chat template (a file or the template itself)
and the live-config file. Each raises ``ConfigError`` with a message naming its source."""

from __future__ import annotations

import json
import os

from kvpilot.engine.errors import ConfigError

ENV_API_KEY = "KVPILOT_API_KEY"
# ``vllm serve``'s key variable, read after kvpilot's own so a script written for vLLM keeps working.
ENV_VLLM_API_KEY = "VLLM_API_KEY"


def read_live_config_file(path: str | None) -> dict | None:
    """The JSON object in ``path`` (``--live-config-file``); None when no path is given or no file is
    there (the settings stay the start-up ones). Raises ConfigError for a file that cannot be read or
    holds anything but a JSON object."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read the live config file {path}: {exc.strerror or exc}") from None
    try:
        update = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise ConfigError(f"the live config file {path} is not JSON: {exc}") from None
    if not isinstance(update, dict):
        raise ConfigError(f"the live config file {path} must hold a JSON object, got {type(update).__name__}")
    return update


def resolve_api_key(flag: str | None, env: str | None, vllm_env: str | None = None) -> str | None:
    """The key to require: ``--api-key`` if given, else ``$KVPILOT_API_KEY``, else ``$VLLM_API_KEY``
    (vllm serve's), normalised by :func:`normalize_api_key`; None when none is set. A set but empty
    variable is an error, not a fall-through to the next source."""
    if flag is not None:
        return normalize_api_key(flag, "--api-key")
    if env is not None:
        return normalize_api_key(env, f"${ENV_API_KEY}")
    return None if vllm_env is None else normalize_api_key(vllm_env, f"${ENV_VLLM_API_KEY}")


def normalize_api_key(key: str, source: str) -> str:
    """``key`` without surrounding whitespace (a key file's final newline); ``ConfigError`` naming
    ``source`` when nothing is left: an empty key must never mean "no authentication"."""
    stripped = key.strip()
    if not stripped:
        raise ConfigError(
            f"the API key from {source} is empty: set a non-empty key, or leave it unset to serve "
            "without authentication"
        )
    return stripped


_TEMPLATE_FILE_SUFFIXES = (".jinja", ".j2", ".txt")


def looks_like_path(value: str) -> bool:
    """Whether a ``--chat-template`` value names a file rather than being a template: no Jinja markers,
    and a path separator or a template-file suffix."""
    if "{{" in value or "{%" in value:
        return False
    return os.sep in value or "/" in value or value.lower().endswith(_TEMPLATE_FILE_SUFFIXES)


def read_chat_template(value: str | None) -> str | None:
    """The template text of ``--chat-template``: the file's contents when ``value`` is an existing
    file, ``value`` itself when it is a template; ``ConfigError`` when it looks like a path (see
    :func:`looks_like_path`) that cannot be read, or names an empty file."""
    if value is None:
        return None
    if not os.path.isfile(value):
        if looks_like_path(value):
            raise ConfigError(f"--chat-template {value!r}: no such file")
        return value
    try:
        with open(value, encoding="utf-8") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--chat-template {value!r}: cannot read it: {exc}") from None
    if not text.strip():
        raise ConfigError(f"--chat-template {value!r}: the file is empty")
    return text
