"""The balancing proxy shared by ``kvpilot router`` and the local platform's front door.

Every request other than the proxy's own routes goes to one ready replica, chosen by ``policy``:

- ``score`` (default): :func:`scoring.pick` on the replicas' scraped gauges (a background task reads
  each one's ``/metrics`` every ``scrape_interval_s`` at most), the door's own in-flight counts and the
  prompt's prefix match in a :class:`prefix.PrefixIndex`;
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
from kvpilot.operator.router.prefix import PrefixConfig, PrefixIndex, block_hashes, prompt_text
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


class _PendingPrefill:
    """A request's uncached prompt blocks, counted in ``pending`` against its replica from the send
    until :meth:`done` (the answer's first output, or the end of the exchange)."""

    def __init__(self, pending: Counter[str], url: str, blocks: int) -> None:
        self.pending, self.url, self.blocks = pending, url, blocks
        pending[url] += blocks

    def done(self) -> None:
        if self.blocks:
            self.pending[self.url] -= self.blocks
            self.blocks = 0


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
        # Uncached prompt blocks sent to each replica whose answer has not begun (prefill queued there).
        self.pending_prefill: Counter[str] = Counter()
        self.served: Counter[str] = Counter()
        self.picks: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.scraper = MetricsScraper(
            endpoints,
            lambda url: self.in_flight[url],
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

    def choose(self, exclude: set[str] = frozenset(), hashes: list[int] = ()) -> scoring.Pick | None:
        """The replica for a request whose prompt has block ``hashes`` (None: no replica left outside
        ``exclude``). Replicas that refused a connection lately are passed over while others remain."""
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
            return scoring.pick(
                [scoring.Candidate(url, self.in_flight[url]) for url in candidates], now=now, turn=turn
            )
        matched = self.prefixes.matches(hashes) if hashes else {}
        loads = self.scraper.loads
        return scoring.pick(
            [
                scoring.Candidate(
                    u, self.in_flight[u], loads.get(u), matched.get(u, 0), self.pending_prefill[u]
                )
                for u in candidates
            ],
            now=now,
            prompt_blocks=len(hashes),
            turn=turn,
            config=self.scoring_config,
        )

    def pick(self, exclude: set[str] = frozenset(), hashes: list[int] = ()) -> str | None:
        """The URL :meth:`choose` picks, or None."""
        chosen = self.choose(exclude, hashes)
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
        if self.policy == POLICY_SCORE:
            text = prompt_text(request.path, body)
            hashes = block_hashes(text, self.prefix_config) if text else []
        tried: set[str] = set()
        held = False
        while True:
            chosen = self.choose(tried, hashes)
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
            prefill = _PendingPrefill(self.pending_prefill, url, chosen.uncached_blocks)
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
                return await self._relay(request, upstream, prefill.done)
            finally:
                prefill.done()
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
            self._refused_at = {u: t for u, t in self._refused_at.items() if u in known}
            for counter in (self.in_flight, self.pending_prefill):  # idle entries of gone replicas
                for u in [u for u, n in counter.items() if u not in known and n == 0]:
                    del counter[u]

    async def _relay(
        self, request: web.Request, upstream: aiohttp.ClientResponse, first_output: Callable[[], None]
    ) -> web.StreamResponse:
        try:
            return await self._copy(request, upstream, first_output)
        except BaseException:
            upstream.close()  # not released to the pool: closing it is what tells the replica to abort
            raise

    async def _copy(
        self, request: web.Request, upstream: aiohttp.ClientResponse, first_output: Callable[[], None]
    ) -> web.StreamResponse:
        async with upstream:
            headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
            await response.prepare(request)
            # When the prefill is over: at the first byte of a whole answer; in an event stream at
            # the second event (a chat stream opens with a role-only event sent before the prefill).
            streamed = upstream.headers.get("Content-Type", "").startswith("text/event-stream")
            events_to_output = 2 if streamed else 0
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
                if events_to_output > 0:
                    events_to_output -= chunk.count(b"data:")
                if events_to_output <= 0:
                    first_output()  # the prefill is over: its work no longer waits at the replica
                try:
                    await response.write(chunk)
                except ConnectionError:
                    upstream.close()  # the client left: closing tells the replica to abort
                    return response
            await response.write_eof()
            return response
