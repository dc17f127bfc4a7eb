"""The local front door: one port in front of the ready replicas, as the Service is in a cluster.

Every OpenAI request (``/v1/...``, streaming included) goes to the ready replica with the fewest
requests in flight through this door (ties in turn), and its answer streams back chunk by chunk as it
is produced. A replica that refuses the connection (it just stopped) is skipped and the next one tried;
once bytes have gone to the client, a failure ends that response. ``/health`` answers 200 while some
replica is ready; ``/local/status`` is the platform's state as JSON (the demo's live view reads it).
A client that disconnects cancels its handler (``handler_cancellation``) and with it the upstream
request, whose connection is closed: the replica sees the disconnect and aborts the request (counted
there as ``finished_reason="abort"``), streamed or not, and the door's in-flight count drops at once.
A replica's own ``/metrics`` stays on the replica (``/local/status`` lists their URLs): one engine's
counters behind a balanced port would mislead.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from kvpilot.operator.api import names

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
STATUS_PATH = "/local/status"


def _error(status: int, message: str, code: str) -> web.Response:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    headers = {"Retry-After": "1"} if status == 503 else None
    return web.json_response(body, status=status, headers=headers)


class FrontDoor:
    """The balancing proxy. ``endpoints()`` returns the base URLs of the ready replicas (called per
    request); ``status()`` the JSON of ``/local/status``."""

    def __init__(
        self,
        endpoints: Callable[[], list[str]],
        status: Callable[[], dict[str, Any]],
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        logger: Any,
    ) -> None:
        self.endpoints = endpoints
        self.status = status
        self.host = host
        self.port = port
        self.logger = logger
        self.in_flight: Counter[str] = Counter()
        self.served: Counter[str] = Counter()
        self._turn = itertools.count()
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> str:
        """Listen (``port`` 0 picks a free one); returns the base URL."""
        app = web.Application(client_max_size=64 << 20)
        app.router.add_get(names.HEALTH_PATH, self._health)
        app.router.add_get(STATUS_PATH, self._status)
        app.router.add_get(names.METRICS_PATH, self._no_metrics)
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
        return self.url

    async def close(self) -> None:
        """Stop listening and drop the upstream connections."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def pick(self, exclude: set[str] = frozenset()) -> str | None:
        """The ready replica with the fewest requests in flight here (ties take turns), or None."""
        candidates = [url for url in self.endpoints() if url not in exclude]
        if not candidates:
            return None
        least = min(self.in_flight[url] for url in candidates)
        tied = [url for url in candidates if self.in_flight[url] == least]
        return tied[next(self._turn) % len(tied)]

    async def _health(self, request: web.Request) -> web.Response:
        if self.endpoints():
            return web.Response(status=200)
        return _error(503, "no replica is ready", "no_ready_replica")

    async def _status(self, request: web.Request) -> web.Response:
        return web.Response(text=json.dumps(self.status(), default=str), content_type="application/json")

    async def _no_metrics(self, request: web.Request) -> web.Response:
        message = f"metrics are per replica: their URLs are in {STATUS_PATH}"
        return web.json_response({"error": {"message": message, "code": "not_found"}}, status=404)

    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        tried: set[str] = set()
        while True:
            url = self.pick(tried)
            if url is None:
                return _error(503, "no replica is ready (starting or restarting)", "no_ready_replica")
            tried.add(url)
            self.in_flight[url] += 1
            try:
                try:
                    # Cancelled (the client left) while the replica works on a non-streamed answer,
                    # aiohttp closes the connection: the replica sees the disconnect and aborts.
                    upstream = await self._session.request(
                        request.method, url + request.path_qs, data=body, headers=headers
                    )
                except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                    self.logger.debug(f"front door: {url} refused {request.path} ({exc!r}); trying another")
                    continue  # nothing reached the replica: another one may take the request
                self.served[url] += 1
                return await self._relay(request, upstream)
            finally:
                self.in_flight[url] -= 1

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        try:
            return await self._copy(request, upstream)
        except BaseException:
            upstream.close()  # not released to the pool: closing it is what tells the replica to abort
            raise

    async def _copy(self, request: web.Request, upstream: aiohttp.ClientResponse) -> web.StreamResponse:
        async with upstream:
            headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP}
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
            await response.prepare(request)
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
                try:
                    await response.write(chunk)
                except ConnectionError:
                    upstream.close()  # the client left: closing tells the replica to abort
                    return response
            await response.write_eof()
            return response

    def snapshot(self) -> dict[str, Any]:
        """The door's own numbers for ``/local/status``."""
        return {
            "url": self.url,
            "inFlight": {url: n for url, n in self.in_flight.items() if n},
            "served": dict(self.served),
        }
