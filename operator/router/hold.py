"""Holding requests while no replica is ready: a service scaled to zero, or one whose only pod restarts.

A request that finds no ready replica waits here instead of failing at once. The first one asks for a
replica (``wake``: the local platform or ``kvpilot router --wake`` stamps the InferenceService's
``wake-requested-at`` annotation, and remediation adds a replica 0 -> 1), and the ask is repeated every
``rewake_s`` while requests wait (a stamp within the second of the scale-down is not newer than it).
Every waiting request is released as soon as some replica is ready. The wait is bounded both ways:
at most ``max_waiting`` requests at once (the next one is refused at once) and ``timeout_s`` each;
either way the caller answers 503 with ``Retry-After``. A client that leaves while waiting just
stops waiting (its handler is cancelled): nothing else is held for it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

OUTCOME_READY = "ready"  # a replica is ready: proxy the request
OUTCOME_FULL = "queue_full"  # max_waiting requests already wait: refused at once
OUTCOME_TIMEOUT = "timeout"  # no replica became ready within timeout_s
OUTCOMES = (OUTCOME_READY, OUTCOME_FULL, OUTCOME_TIMEOUT)


class ColdStartHold:
    """Waits for ``ready()`` (any replica ready) on behalf of requests; see the module docstring.

    ``wake``: an async callable that asks for a replica (its failures are logged and retried at the
    next ``rewake_s``), or None to wait for a replica that comes back by itself. ``poll_s``: how often
    ``ready()`` is checked while requests wait. Counters: ``outcomes`` by outcome, ``wakes`` sent,
    ``wake_errors``; ``waiting`` now.
    """

    def __init__(
        self,
        wake: Callable[[], Awaitable[None]] | None,
        *,
        max_waiting: int = 64,
        timeout_s: float = 300.0,
        rewake_s: float = 5.0,
        poll_s: float = 0.05,
        logger: Any = None,
    ) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be at least 1, not {max_waiting}")
        if timeout_s <= 0 or poll_s <= 0 or rewake_s <= 0:
            raise ValueError("timeout_s, rewake_s and poll_s must be positive")
        self.wake = wake
        self.max_waiting = max_waiting
        self.timeout_s = timeout_s
        self.rewake_s = rewake_s
        self.poll_s = poll_s
        self.logger = logger
        self.waiting = 0
        self.wakes = 0
        self.wake_errors = 0
        self.outcomes: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        self.held_seconds: list[float] = []  # how long each released request waited (last 1,000)
        self._last_wake = float("-inf")
        self._waking: asyncio.Task | None = None

    async def wait(self, ready: Callable[[], bool]) -> str:
        """Wait until ``ready()`` holds: ``OUTCOME_READY``, or ``OUTCOME_FULL`` / ``OUTCOME_TIMEOUT``
        when the request is to be refused."""
        if self.waiting >= self.max_waiting:
            self.outcomes[OUTCOME_FULL] += 1
            return OUTCOME_FULL
        self.waiting += 1
        began = time.monotonic()
        try:
            while not ready():
                now = time.monotonic()
                if now - began >= self.timeout_s:
                    self.outcomes[OUTCOME_TIMEOUT] += 1
                    return OUTCOME_TIMEOUT
                self._maybe_wake(now)
                await asyncio.sleep(self.poll_s)
        finally:
            self.waiting -= 1
        self.outcomes[OUTCOME_READY] += 1
        self.held_seconds = [*self.held_seconds[-999:], time.monotonic() - began]
        return OUTCOME_READY

    def _maybe_wake(self, now: float) -> None:
        """Start one wake call unless one runs or the last began under ``rewake_s`` ago."""
        if self.wake is None or now - self._last_wake < self.rewake_s:
            return
        if self._waking is not None and not self._waking.done():
            return
        self._last_wake = now
        self._waking = asyncio.create_task(self._wake_once())

    async def _wake_once(self) -> None:
        try:
            await self.wake()
            self.wakes += 1
        except Exception as exc:  # an API hiccup: asked again at the next rewake_s
            self.wake_errors += 1
            if self.logger is not None:
                self.logger.warning(f"front door: asking for a replica failed ({exc!r}); asking again")

    async def close(self) -> None:
        """Let a wake call in progress finish (it is one short API write)."""
        if self._waking is not None and not self._waking.done():
            try:
                await asyncio.wait_for(self._waking, timeout=5)
            except (TimeoutError, asyncio.CancelledError):
                pass
