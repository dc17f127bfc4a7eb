"""The engine's typed errors, in one place (torch-free).

Every error the engine raises on purpose derives from ``EngineError``; the edges map the classes, never
a bare ``ValueError``: the server answers ``InvalidRequestError`` with a 400, ``QueueFullError`` with a
503 and ``Retry-After``, ``EngineDeadError`` with a 503; the CLI prints ``ConfigError`` in one line.
The value errors keep ``ValueError`` as a base so that callers catching it still do.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class ConfigError(EngineError, ValueError):
    """An engine argument is invalid; the message names the argument and what is allowed."""


class UnsupportedModelError(ConfigError):
    """The checkpoint uses an architecture or feature this engine does not implement."""


class KVCacheSizeError(ConfigError):
    """The configured memory cannot hold the KV cache the configuration needs."""


class InvalidRequestError(EngineError, ValueError):
    """A request the engine cannot take (too long a prompt, ids outside the vocabulary, a duplicate id,
    a bound exceeded); the message names the field and the limit. Nothing of it was queued.

    ``param`` is the request field at fault and ``code`` an OpenAI error code where one applies
    (``context_length_exceeded``); the server answers with both."""

    def __init__(self, message: str, *, param: str | None = "prompt", code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class SamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range; the message names it."""


class EngineDeadError(EngineError, RuntimeError):
    """The engine loop has stopped (a step raised, or the engine was shut down)."""


class WorkerDiedError(EngineDeadError):
    """A parallel worker died or failed: the engine cannot continue and must be restarted."""


class QueueFullError(EngineError, RuntimeError):
    """``num_waiting`` sequences wait already and the ``num_new`` of this request would pass
    ``max_waiting``; the request was refused whole. Retry after ``retry_after_s``."""

    def __init__(self, num_waiting: int, max_waiting: int, retry_after_s: int, num_new: int = 1) -> None:
        asked = f" + {num_new} requested" if num_new > 1 else ""
        super().__init__(
            f"the server is overloaded: the waiting queue is full ({num_waiting} waiting{asked}, "
            f"limit {max_waiting}); retry after {retry_after_s} s"
        )
        self.num_new = num_new
        self.num_waiting = num_waiting
        self.max_waiting = max_waiting
        self.retry_after_s = retry_after_s
