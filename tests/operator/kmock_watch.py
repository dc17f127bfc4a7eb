"""Watch streams for the Kubernetes API fake, as an API server serves them.

kmock replays every object as ADDED on each connection and streams until the client leaves. A
real API server instead:

- answers a watch from a ``resourceVersion`` older than its history window (compacted) with one
  ``ERROR`` event, code 410 Gone, and ends the stream: the client must list again;
- resumes a watch from a recent ``resourceVersion`` without replaying what the client has seen;
- ends a stream after ``timeoutSeconds`` (and whenever it restarts): the client reconnects;
- sends ``DELETED`` for an object that leaves the watch's label selector, ``ADDED`` when it enters.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
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


@attrs.define
class WatchHistory:
    """What the fake keeps of its watch history: the compaction point and the stream epoch."""

    compacted: int = 0  # a watch from a resourceVersion below this gets 410 Gone
    epoch: int = 0  # bumped to end every open stream (an API server restart, a timeout)
    started: list[tuple[str, str | None]] = attrs.field(factory=list)  # (path, resourceVersion) per watch

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


async def serve(
    events: AsyncIterator[Any],
    params: Any,
    path: str,
    history: WatchHistory,
    matches: Callable[[dict[str, Any]], bool],
) -> AsyncIterator[Any]:
    """The watch stream of ``events`` (kmock's) for a request with query ``params``."""
    since = params.get("resourceVersion")
    history.started.append((path, since))
    since_version = int(since) if since and since.isdigit() else 0
    if since_version and since_version < history.compacted:
        yield b""
        yield GONE
        return
    timeout = float(params.get("timeoutSeconds") or 0)
    deadline = time.monotonic() + timeout if timeout > 0 else None
    epoch = history.epoch
    selected: set[tuple[str, str]] = set()
    iterator = events.__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            pending = asyncio.ensure_future(iterator.__anext__())
            while not pending.done():
                await asyncio.wait({pending}, timeout=0.05)
                expired = deadline is not None and time.monotonic() >= deadline
                if not pending.done() and (expired or history.epoch != epoch):
                    pending.cancel()
                    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                        await pending
                    return
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            if not isinstance(item, dict):
                yield item
                continue
            obj = item.get("object") or {}
            meta = obj.get("metadata") or {}
            key = (meta.get("namespace") or "", meta.get("name") or "")
            if item.get("type") == "ADDED" and since_version and _version(obj) <= since_version:
                if matches(obj):
                    selected.add(key)
                continue  # the client has seen this version already: a resumed watch skips it
            if item.get("type") == "DELETED":
                if key in selected or matches(obj):
                    selected.discard(key)
                    yield item
            elif matches(obj):
                kind = "ADDED" if item.get("type") == "MODIFIED" and key not in selected else item["type"]
                selected.add(key)
                yield {**item, "type": kind}
            elif key in selected:  # left the selector: gone, as far as this watch can tell
                selected.discard(key)
                yield {"type": "DELETED", "object": obj}
    finally:  # the client may leave at any await: never leave the next-event task behind
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        with contextlib.suppress(Exception):
            await iterator.aclose()
