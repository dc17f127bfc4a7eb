"""Reading the engines' ``/metrics``: concurrent HTTP scrapes with short timeouts, and recording them.

``Scraper.scrape(targets)`` fetches every target at once (at most ``concurrency`` in flight), each
within ``timeout_s`` and ``max_bytes``; the whole body is read (a body that arrives in pieces is
waited for, one shorter than its ``Content-Length`` is an error, never a shorter scrape). A target
that fails yields an error string, never an exception.
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

# An engine's /metrics is tens of KiB (vLLM with every histogram: ~25-60 KiB); anything near this is
# not an engine, and the cap bounds what one tenant's pod can make the operator buffer and parse.
MAX_BYTES = 1 << 20
CONCURRENCY = 32
CHUNK = 64 << 10


class BodyError(Exception):
    """A body that is too large or cut short; the message is the scrape's error."""


@dataclasses.dataclass(frozen=True)
class Result:
    """One scrape: ``text`` on success (the /metrics body; parsed samples when the answer came from
    Prometheus, ``observability.promsource``), else ``error`` and its ``kind`` (``timeout``,
    ``http_status``, ``connection``, ``body``); ``time`` when the answer came (unix seconds)."""

    target: Target
    time: float
    text: str | list | None = None
    error: str | None = None
    kind: str | None = None


class Scraper:
    """Concurrent ``GET /metrics`` over one HTTP session."""

    def __init__(
        self,
        timeout_s: float = 3.0,
        concurrency: int = CONCURRENCY,
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
                    if response.status != 200:
                        return Result(
                            target, self.clock(), error=f"HTTP {response.status}", kind="http_status"
                        )
                    body = await self._read(response)
                    return Result(target, self.clock(), text=body.decode("utf-8", errors="replace"))
            except BodyError as exc:
                return Result(target, self.clock(), error=str(exc), kind="body")
            except TimeoutError:
                return Result(
                    target, self.clock(), error=f"no answer within {self.timeout_s:g}s", kind="timeout"
                )
            except aiohttp.ClientError as exc:
                return Result(
                    target, self.clock(), error=f"{type(exc).__name__}: {exc}"[:300], kind="connection"
                )

    async def _read(self, response: aiohttp.ClientResponse) -> bytes:
        """The whole body, up to ``max_bytes``; raises BodyError when it is larger or cut short."""
        too_large = f"body too large: more than {self.max_bytes} bytes (the per-pod cap)"
        expected = response.content_length
        if expected is not None and expected > self.max_bytes:
            raise BodyError(too_large)
        chunks, size = [], 0
        async for chunk in response.content.iter_chunked(CHUNK):
            size += len(chunk)
            if size > self.max_bytes:
                raise BodyError(too_large)
            chunks.append(chunk)
        if expected is not None and size != expected:
            raise BodyError(f"body cut short: {size} of {expected} bytes")
        return b"".join(chunks)


class Recorder:
    """Appends scrapes to a JSON Lines file (``kvpilot replay --metrics`` reads it)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: IO[str] = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 (closed in close())

    def write(
        self, result: Result, tick: float, isvc: dict[str, Any], evaluated: float | None = None
    ) -> None:
        """One line for one scrape of an engine pod of ``isvc``; ``evaluated``: when the policy judged
        the tick (a replay judges it at the same time, so a window is as full as it was then)."""
        self._line(tick, result.time, isvc, result.target.name, True, result.text, result.error, evaluated)

    def write_not_ready(
        self,
        pod: str,
        tick: float,
        isvc: dict[str, Any],
        why: str | None = None,
        evaluated: float | None = None,
    ) -> None:
        """One line for an engine pod of the current configuration that is not ready (not scraped)."""
        self._line(tick, tick, isvc, pod, False, None, why, evaluated)

    def _line(self, tick, time_, isvc, pod, ready, text, error, evaluated) -> None:
        line: dict[str, Any] = {
            "time": round(time_, 3),
            "tick": round(tick, 3),
            "namespace": isvc["metadata"].get("namespace", ""),
            "inferenceService": isvc["metadata"]["name"],
            "pod": pod,
            "ready": ready,
            "metrics": text,
        }
        if evaluated is not None:
            line["evaluated"] = round(evaluated, 3)
        if error is not None:
            line["error"] = error
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()
