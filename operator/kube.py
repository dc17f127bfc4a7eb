"""A small asyncio client for the few Kubernetes API calls the reconciler makes.

It reuses the connection info kopf logs in with (``kopf.ConnectionInfo``: server, CA, token or
client certificate), so the operator talks to one API server with one identity. Children are
written with server-side apply (``application/apply-patch+yaml``, field manager
``kvpilot-operator``, ``force``): the operator owns exactly the fields it renders, and fields it
stops rendering are removed; status is written with a JSON merge patch on ``/status`` carrying
``metadata.resourceVersion``, so a concurrent writer's change is never silently overwritten
(the API server answers 409 and the caller retries with a fresh read).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import aiohttp

from kvpilot.operator.aio import wait_event
from kvpilot.operator.api import names
from kvpilot.operator.api.rest import ApiError, object_path, path_of

REQUEST_TIMEOUT_S = 30


class KubeClient:
    """Authenticated JSON requests to one API server.

    ``use(info)`` installs connection info (a ``kopf.ConnectionInfo``); ``relogin`` (optional)
    returns fresh info after a 401, e.g. a rotated service-account token.
    """

    def __init__(self, relogin: Callable[[], Any] | None = None) -> None:
        self._info: Any = None
        self._session: aiohttp.ClientSession | None = None
        self.relogin = relogin
        self._ready = asyncio.Event()

    def use(self, info: Any) -> None:
        """Switch to new connection info; the next request opens a new session."""
        self._info = info
        old, self._session = self._session, None
        if old is not None and not old.closed:
            asyncio.ensure_future(old.close())
        self._ready.set()

    async def close(self) -> None:
        """Close the HTTP session (at operator shutdown)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _open(self) -> aiohttp.ClientSession:
        info = self._info
        auth = info.as_aiohttp_basic_auth() if info.username else None
        return aiohttp.ClientSession(
            base_url=info.server.rstrip("/") + "/",
            connector=aiohttp.TCPConnector(ssl=info.as_ssl_context()),
            headers={**info.as_http_headers(), "User-Agent": f"{names.FIELD_MANAGER}"},
            auth=auth,
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
        )

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        """One API call; returns the decoded JSON body or raises ApiError."""
        return await self._send(method, path, params, body, content_type)

    async def _send(
        self, method: str, path: str, params: dict[str, str] | None, body: Any, content_type: str
    ) -> dict[str, Any]:
        """The transport under :meth:`request` (an HTTP session to the API server)."""
        if not await wait_event(self._ready, REQUEST_TIMEOUT_S):
            raise TimeoutError(f"no credentials after {REQUEST_TIMEOUT_S}s")
        for attempt in (1, 2):
            if self._session is None or self._session.closed:
                self._session = self._open()
            data = None if body is None else json.dumps(body)
            try:
                async with self._session.request(
                    method,
                    path.lstrip("/"),
                    params=params,
                    data=data,
                    headers={"Content-Type": content_type, "Accept": "application/json"},
                ) as response:
                    text = await response.text()
                    status = response.status
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise ApiError(0, type(exc).__name__, str(exc) or "no answer from the API server") from exc
            if status == 401 and attempt == 1 and self.relogin is not None:
                self.use(await asyncio.to_thread(self.relogin))
                continue
            payload = json.loads(text) if text.strip().startswith("{") else {}
            if status >= 400:
                raise ApiError(status, payload.get("reason") or "Error", payload.get("message") or text[:200])
            return payload
        raise AssertionError("unreachable: the loop returns or raises")

    async def get(self, path: str) -> dict[str, Any] | None:
        """GET an object; None when it does not exist."""
        try:
            return await self.request("GET", path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply ``obj`` (creates it when missing); returns the live object."""
        return await self.request(
            "PATCH",
            path_of(obj),
            params={"fieldManager": names.FIELD_MANAGER, "force": "true"},
            body=obj,
            content_type="application/apply-patch+yaml",
        )

    async def merge_patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        """JSON merge patch (RFC 7386); returns the live object."""
        return await self.request(
            "PATCH",
            path,
            params={"fieldManager": names.FIELD_MANAGER},
            body=patch,
            content_type="application/merge-patch+json",
        )

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        """POST ``obj`` into its collection; returns the created object."""
        meta = obj["metadata"]
        return await self.request(
            "POST", object_path(obj["apiVersion"], obj["kind"], meta.get("namespace")), body=obj
        )

    async def delete(self, path: str) -> None:
        """Delete an object (dependents follow through the garbage collector); 404 is fine."""
        try:
            await self.request("DELETE", path, body={"propagationPolicy": "Background"})
        except ApiError as exc:
            if exc.status != 404:
                raise
