"""The local front door: one port in front of the ready replicas, as the Service is in a cluster.

Every OpenAI request (``/v1/...``, streaming included) goes through the scoring proxy of ``kvpilot
router`` (:class:`kvpilot.operator.router.proxy.BalancingProxy`): by default to the ready replica
predicted to give it its first token soonest, from what the door sent each one and has not seen end, the
prompt's prefix match, and each replica's sizes, rates and gauges (its ``/metrics`` is read in the
background every 200 ms at most; ``policy="least_in_flight"`` or ``"round_robin"`` choose otherwise).
Its answer streams back chunk by chunk as it is produced. A replica that refuses the connection (it just
stopped) is skipped and the next one tried; once bytes have gone to the client, a failure ends that
response. ``/health`` answers 200 while some replica is ready; ``/local/status`` is the platform's state
as JSON (the demo's live view reads it). A client that disconnects cancels its handler
(``handler_cancellation``) and with it the upstream request, whose connection is closed: the replica
sees the disconnect and aborts the request (counted there as ``finished_reason="abort"``), streamed or
not, and the door's in-flight count drops at once. A replica's own ``/metrics`` stays on the replica
(``/local/status`` lists their URLs): one engine's counters behind a balanced port would mislead.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from kvpilot.operator.api import names
from kvpilot.operator.router.proxy import HOP_BY_HOP, POLICY_SCORE, BalancingProxy

__all__ = ["HOP_BY_HOP", "STATUS_PATH", "FrontDoor"]

STATUS_PATH = "/local/status"


class FrontDoor(BalancingProxy):
    """The balancing proxy of the local platform. ``endpoints()`` returns the base URLs of the ready
    replicas (called per request); ``status()`` the JSON of ``/local/status``. ``policy`` and the other
    keyword arguments are :class:`BalancingProxy`'s."""

    def __init__(
        self,
        endpoints: Callable[[], list[str]],
        status: Callable[[], dict[str, Any]],
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        logger: Any,
        policy: str = POLICY_SCORE,
        **options: Any,
    ) -> None:
        super().__init__(endpoints, host=host, port=port, logger=logger, policy=policy, **options)
        self.status = status

    def add_routes(self, app: web.Application) -> None:
        super().add_routes(app)
        app.router.add_get(STATUS_PATH, self._status)
        app.router.add_get(names.METRICS_PATH, self._no_metrics)

    async def _status(self, request: web.Request) -> web.Response:
        return web.Response(text=json.dumps(self.status(), default=str), content_type="application/json")

    async def _no_metrics(self, request: web.Request) -> web.Response:
        message = f"metrics are per replica: their URLs are in {STATUS_PATH}"
        return web.json_response({"error": {"message": message, "code": "not_found"}}, status=404)

    def snapshot(self) -> dict[str, Any]:
        """The door's own numbers for ``/local/status``."""
        return {
            "url": self.url,
            "policy": self.policy,
            "inFlight": {url: n for url, n in self.in_flight.items() if n},
            "served": dict(self.served),
            "picks": dict(self.picks),
            "held": None
            if self.hold is None
            else {"waiting": self.hold.waiting, "wakes": self.hold.wakes, **self.hold.outcomes},
        }
