"""The background reader of each replica's ``/metrics``: one round over the current replicas, then a
pause, so no replica is read more often than every ``interval_s`` and no request waits on a scrape.

Only the three gauges the scorer reads are parsed: the lines of other families are dropped before the
text reaches prometheus-client's parser (an engine's page is mostly histograms), and the operator's own
reader (``remediation.metrics.parse_scrape``) validates them, deprecated names included.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp

from kvpilot.engine import metrics_names as m
from kvpilot.operator.api import names
from kvpilot.operator.remediation.metrics import MetricsParseError, parse_scrape
from kvpilot.operator.router.scoring import EngineLoad

GAUGES = (m.NUM_REQUESTS_WAITING, m.NUM_REQUESTS_RUNNING, m.KV_CACHE_USAGE_PERC)
# The gauges' names as exported, deprecated spellings included.
WANTED = frozenset(GAUGES) | frozenset(a for a, c in m.DEPRECATED_ALIASES.items() if c in GAUGES)


def _family_of(line: str) -> str:
    if line.startswith("#"):
        parts = line.split(None, 3)
        return parts[2] if len(parts) > 2 and parts[1] in ("HELP", "TYPE") else ""
    end = len(line)
    for stop in ("{", " "):
        found = line.find(stop)
        if found != -1:
            end = min(end, found)
    return line[:end]


def engine_load(text: str, now: float, in_flight: int = 0) -> EngineLoad | None:
    """The scorer's gauges from one ``/metrics`` body (None when one is missing or invalid: the
    replica is then costed as if it had no scrape). ``now`` and ``in_flight`` are recorded with it."""
    kept = "\n".join(line for line in text.splitlines() if _family_of(line) in WANTED) + "\n"
    try:
        scrape = parse_scrape(kept, now)
    except MetricsParseError:
        return None
    if scrape.waiting is None or scrape.running is None or scrape.kv_usage is None:
        return None
    return EngineLoad(
        num_requests_waiting=scrape.waiting,
        num_requests_running=scrape.running,
        kv_cache_usage=scrape.kv_usage,
        scraped_at=now,
        in_flight_at_scrape=in_flight,
    )


class MetricsScraper:
    """Reads ``/metrics`` of every URL ``endpoints()`` returns, every ``interval_s`` at most, into
    ``loads`` (URL -> :class:`EngineLoad`). ``in_flight(url)`` is recorded with each scrape;
    ``on_refused(url)`` is called when a replica refuses the connection. ``errors`` counts failed
    scrapes per URL."""

    def __init__(
        self,
        endpoints: Callable[[], list[str]],
        in_flight: Callable[[str], int],
        *,
        interval_s: float = 0.2,
        timeout_s: float = 1.0,
        on_refused: Callable[[str], None] = lambda url: None,
        logger: Any = None,
    ) -> None:
        self.endpoints = endpoints
        self.in_flight = in_flight
        self.interval_s = interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.on_refused = on_refused
        self.logger = logger
        self.loads: dict[str, EngineLoad] = {}
        self.errors: Counter[str] = Counter()
        self.rounds = 0

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Scrape until cancelled."""
        while True:
            urls = list(self.endpoints())
            for gone in set(self.loads) - set(urls):
                del self.loads[gone]
            await asyncio.gather(*(self._one(session, url) for url in urls))
            self.rounds += 1
            await asyncio.sleep(self.interval_s)

    async def _one(self, session: aiohttp.ClientSession, url: str) -> None:
        try:
            async with session.get(url + names.METRICS_PATH, timeout=self.timeout) as response:
                text = await response.text() if response.status == 200 else None
        except aiohttp.ClientConnectorError:
            self.errors[url] += 1
            self.on_refused(url)
            return
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.errors[url] += 1
            if self.logger is not None:
                self.logger.debug(f"router: scraping {url} failed ({exc!r})")
            return
        load = None if text is None else engine_load(text, time.monotonic(), self.in_flight(url))
        if load is None:
            self.errors[url] += 1
            return
        self.loads[url] = load
