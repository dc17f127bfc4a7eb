"""The balancing proxy shared by ``kvpilot router`` and the local platform's front door.

Every request other than the proxy's own routes goes to one ready replica, chosen by ``policy``:

- ``score`` (default): :func:`scoring.pick`, the replica predicted to give the request its first
  token soonest, from the door's own flights to each (what it sent there, in order, and how far each
  answer has come), the prompt's prefix match in a :class:`prefix.PrefixIndex`, and each replica's
  sizes, rates and gauges (a background task reads its ``/metrics`` every ``scrape_interval_s`` at
  most);
- ``least_in_flight``: the fewest requests in flight through this door (ties take turns);
- ``round_robin``: each replica in turn, whatever its load.

The answer streams back chunk by chunk as it is produced. A replica that refuses the connection (it
just stopped) is skipped, the next one tried, and it is passed over for ``REFUSED_BACKOFF_S`` while
another is available; once bytes have gone to the client, a failure ends that response. A client that
disconnects cancels its handler (``handler_cancellation``) and with it the upstream request, whose
connection is closed: the replica sees the disconnect and aborts the request, streamed or not, and the
in-flight count drops at once. With a ``hold`` (:class:`hold.ColdStartHold`), a request that finds no
ready replica at all waits for one (and asks for one: scale from zero) instead of a 503 at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from kvpilot.operator.api import names
from kvpilot.operator.router import scoring
from kvpilot.operator.router.hold import OUTCOME_FULL, OUTCOME_READY, ColdStartHold
from kvpilot.operator.router.prefix import (
    CHAT_COMPLETIONS_PATH,
    PrefixConfig,
    PrefixIndex,
    block_hashes,
    prompt_text,
    request_object,
)
from kvpilot.operator.router.scrape import MetricsScraper

# Hop-by-hop headers (RFC 9110 §7.6.1) and those this proxy recomputes.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
CONNECT_TIMEOUT_S = 2.0
REFUSED_BACKOFF_S = 1.0
POLICY_SCORE = "score"
POLICY_LEAST_IN_FLIGHT = "least_in_flight"
POLICY_ROUND_ROBIN = "round_robin"
POLICIES = (POLICY_SCORE, POLICY_LEAST_IN_FLIGHT, POLICY_ROUND_ROBIN)
# Per-replica counters of replicas gone are dropped past this many series (pod IPs come and go).
MAX_TRACKED_REPLICAS = 256


class _Flights:
    """The door's flights (:class:`scoring.Flight`) per replica, in sending order; the running mean
    of how many tokens an answer brings (from the streamed answers that ended) and of the uncached
    prompt tokens a request brings."""

    SMOOTHING = 0.1  # weight of the newest answer in the mean

    def __init__(self) -> None:
        self.by_url: dict[str, dict[int, scoring.Flight]] = {}
        self.typical_output: float | None = None
        self.typical_prompt: float | None = None
        # Per replica, cumulative: requests seen end and their prompts' characters.
        self.ended: Counter[str] = Counter()
        self.ended_chars: Counter[str] = Counter()
        self._ids = itertools.count()

    def add(self, url: str, flight: scoring.Flight) -> int:
        mean = self.typical_prompt
        sample = flight.uncached_tokens
        self.typical_prompt = sample if mean is None else mean + self.SMOOTHING * (sample - mean)
        key = next(self._ids)
        self.by_url.setdefault(url, {})[key] = flight
        return key

    def end(self, url: str, key: int, outputs: int | None) -> None:
        """The answer ended; ``outputs``: the tokens it brought (None: not counted)."""
        flights = self.by_url.get(url, {})
        flight = flights.pop(key, None)
        if flight is not None:
            self.ended[url] += 1
            self.ended_chars[url] += flight.prompt_chars
        if not flights:
            self.by_url.pop(url, None)
        if outputs is not None and outputs > 0:
            mean = self.typical_output
            self.typical_output = outputs if mean is None else mean + self.SMOOTHING * (outputs - mean)

    def ended_of(self, url: str) -> tuple[int, float]:
        """(requests seen end at ``url``, their prompts' characters), cumulative."""
        return self.ended[url], float(self.ended_chars[url])

    def forget(self, urls: set[str]) -> None:
        """Drop the counts of replicas gone (none of their flights is left)."""
        for url in urls:
            if url not in self.by_url:
                self.ended.pop(url, None)
                self.ended_chars.pop(url, None)

    def of(self, url: str) -> list[scoring.Flight]:
        return list(self.by_url.get(url, {}).values())

    def pending_prefill_tokens(self, url: str) -> float:
        """Uncached prompt tokens sent to ``url`` whose answer has not begun (prefill queued there)."""
        return sum(f.uncached_tokens for f in self.by_url.get(url, {}).values() if not f.prefilled)


def max_tokens_of(request: dict[str, Any] | None) -> int | None:
    """An OpenAI request's output bound (``max_completion_tokens`` or ``max_tokens``), None without."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = (request or {}).get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def error_response(status: int, message: str, code: str) -> web.Response:
    """An OpenAI-shaped error; a 503 carries ``Retry-After: 1``."""
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    headers = {"Retry-After": "1"} if status == 503 else None
    return web.json_response(body, status=status, headers=headers)


class BalancingProxy:
    """``endpoints()`` returns the base URLs of the ready replicas (called per request and per scrape
    round). Subclasses add their own routes in :meth:`add_routes`. Counters: ``in_flight`` and
    ``served`` per replica, ``picks`` per reason (``scoring.REASONS``), ``refused`` per replica."""

    def __init__(
        self,
        endpoints: Callable[[], list[str]],
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        logger: Any,
        policy: str = POLICY_SCORE,
        scoring_config: scoring.ScoringConfig | None = None,
        prefix_config: PrefixConfig | None = None,
        scrape_interval_s: float = 0.2,
        hold: ColdStartHold | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        self.endpoints = endpoints
        self.host = host
        self.port = port
        self.logger = logger
        self.policy = policy
        self.hold = hold
        self.scoring_config = scoring_config or scoring.ScoringConfig()
        self.prefix_config = prefix_config or PrefixConfig()
        self.prefixes = PrefixIndex(self.prefix_config)
        self.in_flight: Counter[str] = Counter()
        # What the door sent each replica and has not seen end: the scorer's view of its queue.
        self.flights = _Flights()
        self.served: Counter[str] = Counter()
        self.picks: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.scraper = MetricsScraper(
            endpoints,
            lambda url: self.in_flight[url],
            ended=self.flights.ended_of,
            interval_s=scrape_interval_s,
            on_refused=self._mark_refused,
            logger=logger,
        )
        self._refused_at: dict[str, float] = {}
        self._turn = itertools.count()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def add_routes(self, app: web.Application) -> None:
        """Routes of the proxy's own, added before the catch-all that proxies (``/health`` here)."""
        app.router.add_get(names.HEALTH_PATH, self._health)

    def background(self) -> list[Any]:
        """Coroutines to run while listening (cancelled by :meth:`close`): the scraper for ``score``."""
        return [self.scraper.run(self._session)] if self.policy == POLICY_SCORE else []

    async def start(self) -> str:
        """Listen (``port`` 0 picks a free one) and start the background tasks; returns the base URL."""
        app = web.Application(client_max_size=64 << 20)
        self.add_routes(app)
        app.router.add_route("*", "/{tail:.*}", self._proxy)
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S),
            connector=aiohttp.TCPConnector(limit=0),
            auto_decompress=False,
        )
        # Without handler cancellation aiohttp lets a handler run on after its client left: a
        # non-streamed request would generate to max_tokens on the replica for nobody.
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self._tasks = [asyncio.create_task(coro) for coro in self.background()]
        return self.url

    async def close(self) -> None:
        """Stop the background tasks and listening, and drop the upstream connections."""
        if self.hold is not None:
            await self.hold.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    # ------------------------------------------------------------------------------------ picking
    def _mark_refused(self, url: str) -> None:
        self._refused_at[url] = time.monotonic()

    def choose(
        self, exclude: set[str] = frozenset(), hashes: list[int] = (), prompt_chars: int = 0
    ) -> scoring.Pick | None:
        """The replica for a request whose prompt of ``prompt_chars`` characters has block ``hashes``
        (None: no replica left outside ``exclude``). Replicas that refused a connection lately are
        passed over while others remain."""
        now = time.monotonic()
        candidates = [url for url in self.endpoints() if url not in exclude]
        recent = {u for u, at in self._refused_at.items() if now - at < REFUSED_BACKOFF_S}
        candidates = [u for u in candidates if u not in recent] or candidates
        if not candidates:
            return None
        turn = next(self._turn)
        if self.policy == POLICY_ROUND_ROBIN:
            url = candidates[turn % len(candidates)]
            return scoring.Pick(url=url, reason=scoring.REASON_ROUND_ROBIN, costs={})
        if self.policy == POLICY_LEAST_IN_FLIGHT:
            counts = {url: float(self.in_flight[url]) for url in candidates}
            fewest = [url for url in candidates if counts[url] == min(counts.values())]
            return scoring.Pick(url=fewest[turn % len(fewest)], reason=scoring.REASON_LOAD, costs=counts)
        matched = self.prefixes.matches(hashes) if hashes else {}
        loads = self.scraper.loads
        learned = self.scraper.tokens_per_char
        chars_per_token = 1.0 / learned if learned else self.prefix_config.chars_per_token
        return scoring.pick(
            [scoring.Candidate(u, self.flights.of(u), loads.get(u), matched.get(u, 0)) for u in candidates],
            now=now,
            prompt_tokens=prompt_chars / chars_per_token,
            tokens_per_block=self.prefix_config.block_chars / chars_per_token,
            typical_output=self.flights.typical_output,
            typical_prompt=self.flights.typical_prompt,
            turn=turn,
            config=self.scoring_config,
        )

    def pick(
        self, exclude: set[str] = frozenset(), hashes: list[int] = (), prompt_chars: int = 0
    ) -> str | None:
        """The URL :meth:`choose` picks, or None."""
        chosen = self.choose(exclude, hashes, prompt_chars)
        return None if chosen is None else chosen.url

    # ------------------------------------------------------------------------------------ handlers
    async def _health(self, request: web.Request) -> web.Response:
        if self.endpoints():
            return web.Response(status=200)
        return error_response(503, "no replica is ready", "no_ready_replica")

    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        hashes: list[int] = []
        prompt_chars = 0
        parsed = None
        if self.policy == POLICY_SCORE:
            parsed = request_object(body)
            text = prompt_text(request.path, parsed)
            hashes = block_hashes(text, self.prefix_config) if text else []
            prompt_chars = len(text) if text else 0
        tried: set[str] = set()
        held = False
        while True:
            chosen = self.choose(tried, hashes, prompt_chars)
            if chosen is None and not tried and not held and self.hold is not None:
                held = True  # none ready (scaled to zero, or restarting): wait for one, once
                outcome = await self.hold.wait(lambda: bool(self.endpoints()))
                if outcome == OUTCOME_READY:
                    continue
                if outcome == OUTCOME_FULL:
                    message = f"no replica is ready and {self.hold.max_waiting} requests already wait for one"
                    return error_response(503, message, "no_ready_replica")
                message = f"no replica became ready within {self.hold.timeout_s:g}s"
                return error_response(503, message, "no_ready_replica")
            if chosen is None:
                return error_response(503, "no replica is ready (starting or restarting)", "no_ready_replica")
            url = chosen.url
            tried.add(url)
            self.in_flight[url] += 1
            flight = scoring.Flight(chosen.uncached_tokens, max_tokens_of(parsed), prompt_chars=prompt_chars)
            key = self.flights.add(url, flight)
            counted: list[int | None] = [None]
            try:
                try:
                    # Cancelled (the client left) while the replica works on a non-streamed answer,
                    # aiohttp closes the connection: the replica sees the disconnect and aborts.
                    upstream = await self._session.request(
                        request.method, url + request.path_qs, data=body, headers=headers
                    )
                except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                    self.logger.debug(f"front door: {url} refused {request.path} ({exc!r}); trying another")
                    self.refused[url] += 1
                    self._mark_refused(url)
                    continue  # nothing reached the replica: another one may take the request
                self._count(url, chosen.reason)
                if hashes:
                    self.prefixes.record(hashes, url)
                response = await self._relay(request, upstream, flight)
                counted[0] = flight.outputs if flight.prefilled else None
                return response
            finally:
                self.flights.end(url, key, counted[0])
                self.in_flight[url] -= 1

    def _count(self, url: str, reason: str) -> None:
        self.served[url] += 1
        self.picks[reason] += 1
        if len(self.served) > MAX_TRACKED_REPLICAS:
            known = set(self.endpoints())
            counters = (self.served, self.refused, self.scraper.errors)
            gone = {u for counter in counters for u in counter if u not in known}
            for counter in counters:
                for u in gone & set(counter):
                    del counter[u]
            self.prefixes.forget(gone)
            self.flights.forget(gone)
            self._refused_at = {u: t for u, t in self._refused_at.items() if u in known}
            for u in [u for u, n in self.in_flight.items() if u not in known and n == 0]:
                del self.in_flight[u]  # idle entries of gone replicas

    async def _relay(
        self, request: web.Request, upstream: aiohttp.ClientResponse, flight: scoring.Flight
    ) -> web.StreamResponse:
        try:
            return await self._copy(request, upstream, flight)
        except BaseException:
            upstream.close()  # not released to the pool: closing it is what tells the replica to abort
            raise

    async def _copy(
        self, request: web.Request, upstream: aiohttp.ClientResponse, flight: scoring.Flight
    ) -> web.StreamResponse:
        """Stream the answer to the client, keeping ``flight`` current: its prefill is over at the
        answer's first output, and a streamed answer's events count its output tokens."""
        async with upstream:
            headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
            await response.prepare(request)
            # A whole answer's first byte is its output; in an event stream each event is about a
            # token, less the role-only event a chat stream opens with (sent before the prefill) and
            # the closing [DONE].
            streamed = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
            opening = 1 if streamed and request.path == CHAT_COMPLETIONS_PATH else 0
            events = 0
            chunks = upstream.content.iter_any()
            while True:
                try:
                    chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    break
                except (aiohttp.ClientError, asyncio.IncompleteReadError) as exc:
                    # The replica died mid-answer: the client sees the stream end early.
                    self.logger.warning(f"front door: {request.path} cut short by its replica ({exc!r})")
                    if request.transport is not None:
                        request.transport.close()
                    return response
                if streamed:
                    events += chunk.count(b"data:") - chunk.count(b"data: [DONE]")
                    flight.outputs = max(0, events - opening)
                flight.prefilled = flight.prefilled or not streamed or flight.outputs > 0
                try:
                    await response.write(chunk)
                except ConnectionError:
                    upstream.close()  # the client left: closing tells the replica to abort
                    return response
            await response.write_eof()
            return response
