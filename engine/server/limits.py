"""Bounds on what one request may cost: ``RequestLimits`` (the per-request bounds ``kvpilot serve``
enforces beyond the body's types) and ``UnknownFieldsLog`` (the warning about ignored fields, at a
bounded rate and with constant state).

Dependency-free, so that the CLI shows the defaults in ``--help`` without loading the server. The checks
themselves are in ``protocol``; each 400 names the bound and its flag.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvpilot.engine.errors import ConfigError

logger = logging.getLogger("kvpilot.server")


@dataclass(frozen=True)
class RequestLimits:
    """Per-request bounds (each a ``kvpilot serve`` flag of the same name in kebab-case).

    ``max_stop_sequences`` / ``max_stop_sequence_length``: ``stop`` strings per request and characters
    per string (OpenAI allows 4 strings, vLLM any number: 64 covers every template's end markers).
    ``max_stop_token_ids``: entries of ``stop_token_ids``. ``max_sequences_per_request``: prompts x
    ``n``, the sequences one request adds (256, vLLM's default ``max_num_seqs``: one request may fill
    one whole batch, not a queue of thousands). Raises ``ConfigError`` for a negative bound (or a
    sequence bound below 1).
    """

    max_stop_sequences: int = 64
    max_stop_sequence_length: int = 256
    max_stop_token_ids: int = 256
    max_sequences_per_request: int = 256

    def __post_init__(self) -> None:
        for name in ("max_stop_sequences", "max_stop_sequence_length", "max_stop_token_ids"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_sequences_per_request < 1:
            raise ConfigError(f"max_sequences_per_request must be >= 1, got {self.max_sequences_per_request}")


class UnknownFieldsLog:
    """Warns about ignored request fields at most once per ``interval_s``, process-wide.

    Each warning names at most ``max_names`` fields of the request that triggered it, how many it had,
    and how many requests with unknown fields went unreported since the previous warning. The state is
    two numbers, whatever the clients send.
    """

    def __init__(self, interval_s: float = 60.0, max_names: int = 5) -> None:
        self.interval_s = interval_s
        self.max_names = max_names
        self._lock = threading.Lock()
        self._last: float | None = None
        self._num_suppressed = 0

    def observe(self, fields: dict[str, Any]) -> None:
        if not fields:
            return
        now = time.monotonic()
        with self._lock:
            if self._last is not None and now - self._last < self.interval_s:
                self._num_suppressed += 1
                return
            self._last, suppressed, self._num_suppressed = now, self._num_suppressed, 0
        names = [name[:64] for name, _ in zip(fields, range(self.max_names), strict=False)]
        more = f" and {len(fields) - len(names)} more" if len(fields) > len(names) else ""
        logger.warning(
            "ignoring %d unsupported request field(s): %s%s (at most one such warning per %g s; "
            "%d request(s) with unsupported fields since the last one)",
            len(fields),
            ", ".join(repr(name) for name in names),
            more,
            self.interval_s,
            suppressed,
        )
