"""Watch streams for the Kubernetes API fake, as an API server serves them.

kmock replays every object as ADDED on each connection and streams until the client leaves. A
real API server instead:

- answers a watch from a ``resourceVersion`` older than its history window (compacted) with one
  ``ERROR`` event, code 410 Gone, and ends the stream: the client must list again;
- resumes a watch from a recent ``resourceVersion`` without replaying what the client has seen;
- ends a stream after ``timeoutSeconds``, or sooner after a timeout of its own (its
  ``--min-request-timeout``), and whenever it restarts: the client reconnects;
- sends ``BOOKMARK`` events to a client that asked with ``allowWatchBookmarks``: an object with only
  ``metadata.resourceVersion``, the newest version the server has written whose events the stream
  has already delivered, so a client can resume from there without a replay (and one more right
  before it ends a stream on its timeout);
- sends ``DELETED`` for an object that leaves the watch's label selector, ``ADDED`` when it enters.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import attrs
import kmock

GONE = {
    "type": "ERROR",
    "object": {
        "apiVersion": "v1",
        "kind": "Status",
        "status": "Failure",
        "code": 410,
        "reason": "Expired",
        "message": "too old resource version",
    },
}


# Consumer hand-offs a bus event needs to reach a stream waiting for it (kmock's bus, its generator,
# ours): a bookmark is sent only after this many turns of the event loop found nothing pending.
SETTLE_TURNS = 20


@attrs.define
class WatchHistory:
    """What the fake keeps of its watch history and how its watches behave.

    ``max_timeout_s``: the server's own timeout for a watch (None: only the client's ``timeoutSeconds``).
    ``bookmark_interval_s``: how often an idle stream that allows bookmarks gets one (None: never).
    """

    compacted: int = 0  # a watch from a resourceVersion below this gets 410 Gone
    epoch: int = 0  # bumped to end every open stream (an API server restart, a timeout)
    started: list[tuple[str, str | None]] = attrs.field(factory=list)  # (path, resourceVersion) per watch
    sent: list[tuple[str, str, str]] = attrs.field(factory=list)  # (path, type, resourceVersion) per event
    ended: list[tuple[str, str]] = attrs.field(factory=list)  # (path, why) per stream the server ended
    max_timeout_s: float | None = None
    bookmark_interval_s: float | None = None

    def expire(self, next_version: int) -> None:
        """Forget every version before ``next_version`` and end the open streams."""
        self.compacted = next_version
        self.epoch += 1


def matches_selector(obj: dict[str, Any], selector: str) -> bool:
    """Equality-based label selectors: ``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k`` (comma = and)."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif " in " in term or " notin " in term:
            raise kmock.KubernetesError(
                status=400, reason="BadRequest", message=f"unsupported selector {term!r}"
            )
        elif term not in labels:
            return False
    return True


def _version(obj: dict[str, Any]) -> int:
    try:
        return int((obj.get("metadata") or {}).get("resourceVersion") or 0)
    except ValueError:
        return 0


def _timeout(params: Any, history: WatchHistory) -> float | None:
    """Seconds until the server ends the stream: the client's ``timeoutSeconds``, capped by the
    server's own; None: never."""
    asked = float(params.get("timeoutSeconds") or 0)
    limits = [t for t in (asked if asked > 0 else None, history.max_timeout_s) if t is not None]
    return min(limits) if limits else None


async def _settle(pending: asyncio.Future) -> bool:
    """Let the event loop turn until ``pending`` is done, at most ``SETTLE_TURNS`` times; whether it is."""
    for _ in range(SETTLE_TURNS):
        if pending.done():
            return True
        await asyncio.sleep(0)
    return pending.done()


async def serve(
    events: AsyncIterator[Any],
    params: Any,
    path: str,
    history: WatchHistory,
    matches: Callable[[dict[str, Any]], bool],
    settled_version: Callable[[], Awaitable[int]] | None = None,
    bookmark_template: dict[str, Any] | None = None,
    write_lock: asyncio.Lock | None = None,
) -> AsyncIterator[Any]:
    """The watch stream of ``events`` (kmock's) for a request with query ``params``.

    ``settled_version``: the newest resourceVersion written whose events are on kmock's bus already
    (awaited between writes); bookmarks need it. ``bookmark_template``: apiVersion and kind of a
    bookmark's object. ``write_lock``: the lock every write holds; held while the stream starts, so
    no write falls between kmock's snapshot of the objects and its subscription to their events, and
    the client, once it has the response headers, misses nothing it writes or anyone writes after.
    """
    since = params.get("resourceVersion")
    history.started.append((path, since))
    since_version = int(since) if since and since.isdigit() else 0
    if since_version and since_version < history.compacted:
        yield b""
        yield GONE
        return
    timeout = _timeout(params, history)
    deadline = time.monotonic() + timeout if timeout is not None else None
    bookmarks = (
        params.get("allowWatchBookmarks") == "true"
        and history.bookmark_interval_s is not None
        and settled_version is not None
    )
    interval = history.bookmark_interval_s or 0.0
    next_bookmark = time.monotonic() + interval
    epoch = history.epoch
    selected: set[tuple[str, str]] = set()
    newest = since_version  # the newest version this stream has delivered (or resumed from)
    iterator = events.__aiter__()
    pending: asyncio.Future | None = None
    queued: collections.deque[Any] = collections.deque()

    async def bookmark() -> dict[str, Any] | None:
        """A bookmark at the settled version, or None if an event turned up meanwhile (it goes first)."""
        assert settled_version is not None and pending is not None
        version = await settled_version()
        if await _settle(pending):
            return None
        meta = {"resourceVersion": str(max(version, newest))}
        return {"type": "BOOKMARK", "object": {**(bookmark_template or {}), "metadata": meta}}

    try:
        # kmock answers with the headers (b""), the objects as ADDED, then its bus: take all of it up
        # to the bus subscription before the client sees the headers.
        async with write_lock or contextlib.nullcontext():
            headers = await iterator.__anext__()
            while True:
                pending = asyncio.ensure_future(iterator.__anext__())
                if not await _settle(pending):
                    break  # waiting on the bus: subscribed
                try:
                    queued.append(pending.result())
                except StopAsyncIteration:
                    pending = None
                    break
        yield headers
        while queued or pending is not None:
            if queued:
                item = queued.popleft()
            else:
                assert pending is not None
                while not pending.done():
                    await asyncio.wait({pending}, timeout=0.05)
                    if pending.done():
                        break
                    expired = deadline is not None and time.monotonic() >= deadline
                    if bookmarks and (expired or time.monotonic() >= next_bookmark):
                        event = await bookmark()
                        if event is None:
                            break  # an event arrived: deliver it first
                        next_bookmark = time.monotonic() + interval
                        newest = int(event["object"]["metadata"]["resourceVersion"])
                        history.sent.append((path, "BOOKMARK", str(newest)))
                        yield event
                    if expired or history.epoch != epoch:
                        history.ended.append((path, "timeout" if expired else "expired"))
                        return
                try:
                    item = await pending
                except StopAsyncIteration:
                    return
                pending = asyncio.ensure_future(iterator.__anext__())
            if not isinstance(item, dict):
                yield item
                continue
            obj = item.get("object") or {}
            newest = max(newest, _version(obj))
            meta = obj.get("metadata") or {}
            key = (meta.get("namespace") or "", meta.get("name") or "")
            if item.get("type") == "ADDED" and since_version and _version(obj) <= since_version:
                if matches(obj):
                    selected.add(key)
                continue  # the client has seen this version already: a resumed watch skips it
            out = None
            if item.get("type") == "DELETED":
                if key in selected or matches(obj):
                    selected.discard(key)
                    out = item
            elif matches(obj):
                kind = "ADDED" if item.get("type") == "MODIFIED" and key not in selected else item["type"]
                selected.add(key)
                out = {**item, "type": kind}
            elif key in selected:  # left the selector: gone, as far as this watch can tell
                selected.discard(key)
                out = {"type": "DELETED", "object": obj}
            if out is not None:
                history.sent.append((path, out["type"], str(_version(obj))))
                yield out
    finally:  # the client may leave at any await: never leave the next-event task behind
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        with contextlib.suppress(Exception):
            await iterator.aclose()
