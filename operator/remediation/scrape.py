"""Reading the engines' ``/metrics``: concurrent HTTP scrapes with short timeouts, and recording them.

``Scraper.scrape(targets)`` fetches every target at once (bounded concurrency), each within
``timeout_s`` and ``max_bytes``; a target that fails yields an error string, never an exception.
``Recorder`` appends each scrape as one JSON line in the format ``kvpilot replay`` reads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable, Iterable
from typing import IO, Any

import aiohttp

from kvpilot.operator.api import names
from kvpilot.operator.remediation.pods import Target

MAX_BYTES = 8 << 20  # an engine's /metrics is ~20 KiB; anything near this is not an engine


@dataclasses.dataclass(frozen=True)
class Result:
    """One scrape: ``text`` on success, else ``error``; ``time`` when the answer came (unix seconds)."""

    target: Target
    time: float
    text: str | None = None
    error: str | None = None


class Scraper:
    """Concurrent ``GET /metrics`` over one HTTP session."""

    def __init__(
        self,
        timeout_s: float = 3.0,
        concurrency: int = 64,
        max_bytes: int = MAX_BYTES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.clock = clock
        self._limit = asyncio.Semaphore(concurrency)
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def scrape(self, targets: Iterable[Target]) -> list[Result]:
        """Scrape every target concurrently; results in the order of ``targets``."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                headers={"User-Agent": names.FIELD_MANAGER, "Accept": "text/plain"},
            )
        return list(await asyncio.gather(*(self._one(t) for t in targets)))

    async def _one(self, target: Target) -> Result:
        async with self._limit:
            try:
                async with self._session.get(target.url, allow_redirects=False) as response:
                    body = await response.content.read(self.max_bytes + 1)
                    if response.status != 200:
                        return Result(target, self.clock(), error=f"HTTP {response.status}")
                    if len(body) > self.max_bytes:
                        return Result(
                            target, self.clock(), error=f"response larger than {self.max_bytes} bytes"
                        )
                    return Result(target, self.clock(), text=body.decode("utf-8", errors="replace"))
            except TimeoutError:
                return Result(target, self.clock(), error=f"no answer within {self.timeout_s:g}s")
            except aiohttp.ClientError as exc:
                return Result(target, self.clock(), error=f"{type(exc).__name__}: {exc}"[:300])


class Recorder:
    """Appends scrapes to a JSON Lines file (``kvpilot replay --metrics`` reads it)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: IO[str] = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 (closed in close())

    def write(self, result: Result, tick: float, isvc: dict[str, Any]) -> None:
        """One line for one scrape of an engine pod of ``isvc``."""
        self._line(tick, result.time, isvc, result.target.name, True, result.text, result.error)

    def write_not_ready(self, pod: str, tick: float, isvc: dict[str, Any], why: str | None = None) -> None:
        """One line for an engine pod of the current configuration that is not ready (not scraped)."""
        self._line(tick, tick, isvc, pod, False, None, why)

    def _line(self, tick, time_, isvc, pod, ready, text, error) -> None:
        line: dict[str, Any] = {
            "time": round(time_, 3),
            "tick": round(tick, 3),
            "namespace": isvc["metadata"].get("namespace", ""),
            "inferenceService": isvc["metadata"]["name"],
            "pod": pod,
            "ready": ready,
            "metrics": text,
        }
        if error is not None:
            line["error"] = error
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()
