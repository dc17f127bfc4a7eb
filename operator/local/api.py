"""An in-memory Kubernetes API for the local platform: the operator's own client, minus the network.

:class:`LocalApi` is a :class:`~kvpilot.operator.kube.KubeClient` whose transport is a dict instead of
an API server. ``request``, ``get``, ``apply``, ``merge_patch``, ``create`` and ``delete`` are inherited
unchanged; only the transport under them is replaced. So the ``Reconciler`` and the ``Autotuner`` run
against it exactly as they run against a cluster, and the local kubelet (``local.replicas``) reads the
Deployment they render and writes the Pods and Deployment status a cluster's controllers would.

What it keeps of an API server's behaviour, because the operator relies on it: ``uid``,
``resourceVersion``, ``generation`` (bumped on spec changes only), ``creationTimestamp``; server-side
apply replaces what the applier renders and keeps ``status``; a write to ``/status`` changes only status
and answers 409 when its ``metadata.resourceVersion`` is stale; lists honour equality label selectors.
Objects are copied in and out, as over the wire.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import uuid
from typing import Any

from kvpilot.operator.api.patch import merge_patch
from kvpilot.operator.api.rest import ApiError
from kvpilot.operator.api.timefmt import rfc3339
from kvpilot.operator.kube import KubeClient

# (plural, namespace, name)
Key = tuple[str, str | None, str]


def parse_path(path: str) -> tuple[str, str | None, str | None, str | None]:
    """``/apis/g/v/namespaces/ns/plural/name/sub`` -> (plural, namespace, name, subresource).

    Raises ApiError(404) for a path that is not a resource path.
    """
    parts = [p for p in path.split("?")[0].split("/") if p]
    if parts[:1] == ["api"]:
        rest = parts[2:]
    elif parts[:1] == ["apis"]:
        rest = parts[3:]
    else:
        raise ApiError(404, "NotFound", f"no such path {path}")
    namespace = None
    if rest[:1] == ["namespaces"] and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    if not rest or len(rest) > 3:
        raise ApiError(404, "NotFound", f"no such path {path}")
    plural, name, sub = rest[0], rest[1] if len(rest) > 1 else None, rest[2] if len(rest) > 2 else None
    return plural, namespace, name, sub


def matches(labels: dict[str, str] | None, selector: str | None) -> bool:
    """Whether ``labels`` satisfy an equality selector ``k=v,k2=v2`` (``k`` alone: the key exists)."""
    labels = labels or {}
    for term in filter(None, (t.strip() for t in (selector or "").split(","))):
        key, sep, value = term.partition("=")
        key, value = key.rstrip("="), value.lstrip("=")
        if key.endswith("!"):
            if labels.get(key[:-1]) == value:
                return False
        elif not sep:
            if key not in labels:
                return False
        elif labels.get(key) != value:
            return False
    return True


class LocalApi(KubeClient):
    """The store behind the local platform (see the module docstring). ``changed`` is set on every write."""

    def __init__(self) -> None:
        super().__init__()
        self._objects: dict[Key, dict[str, Any]] = {}
        self._versions = itertools.count(1)
        self.changed = asyncio.Event()
        self._ready.set()  # no login: the store is there from the start

    async def close(self) -> None:
        """Nothing to close (no session)."""

    # --- direct access for the local controllers (synchronous: same process, no wire) ------------

    def read(self, path: str) -> dict[str, Any] | None:
        """A copy of the object at ``path``, or None."""
        plural, namespace, name, _ = parse_path(path)
        obj = self._objects.get((plural, namespace, name or ""))
        return copy.deepcopy(obj) if obj is not None else None

    def list(self, plural: str, namespace: str | None, selector: str | None = None) -> list[dict[str, Any]]:
        """Copies of the objects of ``plural`` in ``namespace`` (None: all) matching ``selector``."""
        return [
            copy.deepcopy(obj)
            for (kind, ns, _), obj in sorted(self._objects.items(), key=lambda item: item[0][2])
            if kind == plural
            and (namespace is None or ns == namespace)
            and matches(obj["metadata"].get("labels"), selector)
        ]

    def put(self, path: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Store ``obj`` at ``path`` whole, status included (the kubelet's Pods); returns a copy."""
        plural, namespace, name, _ = parse_path(path)
        key = (plural, namespace, name or "")
        old = self._objects.get(key)
        if (
            old is not None
            and all(old.get(k) == obj.get(k) for k in ("spec", "status"))
            and all(old["metadata"].get(k) == obj["metadata"].get(k) for k in ("labels", "deletionTimestamp"))
        ):
            return copy.deepcopy(old)  # unchanged: no new resourceVersion, no wake-up
        return self._store(key, copy.deepcopy(obj), old)

    def write_status(self, path: str, status: dict[str, Any]) -> bool:
        """Replace the status of the object at ``path`` (a controller's status write); whether it changed."""
        plural, namespace, name, _ = parse_path(path)
        key = (plural, namespace, name or "")
        live = self._objects.get(key)
        if live is None or live.get("status") == status:
            return False
        updated = copy.deepcopy(live)
        updated["status"] = copy.deepcopy(status)
        self._store(key, updated, live)
        return True

    def remove(self, path: str) -> bool:
        """Delete the object at ``path``; whether it existed."""
        plural, namespace, name, _ = parse_path(path)
        found = self._objects.pop((plural, namespace, name or ""), None) is not None
        if found:
            self.changed.set()
        return found

    # --- the transport KubeClient's methods call ----------------------------------------------

    async def _send(
        self, method: str, path: str, params: dict[str, str] | None, body: Any, content_type: str
    ) -> dict[str, Any]:
        """One API call against the store; the decoded answer or ApiError, as over the wire."""
        plural, namespace, name, sub = parse_path(path)
        key: Key = (plural, namespace, name or "")
        live = self._objects.get(key)
        if method == "GET":
            if name is None:
                selector = (params or {}).get("labelSelector")
                return {"kind": "List", "items": self.list(plural, namespace, selector)}
            if live is None:
                raise ApiError(404, "NotFound", f"{plural} {name} not found")
            return copy.deepcopy(live)
        if method == "POST":
            name = (body.get("metadata") or {}).get("name")
            key = (plural, namespace, name)
            if key in self._objects:
                raise ApiError(409, "AlreadyExists", f"{plural} {name} already exists")
            return self._store(key, copy.deepcopy(body), None)
        if method == "DELETE":
            if self._objects.pop(key, None) is None:
                raise ApiError(404, "NotFound", f"{plural} {name} not found")
            self.changed.set()
            return {}
        if method != "PATCH":
            raise ApiError(405, "MethodNotAllowed", method)
        if content_type == "application/apply-patch+yaml":
            desired = copy.deepcopy(body)
            if live is not None:
                desired["status"] = copy.deepcopy(live.get("status"))
                if desired["status"] is None:
                    desired.pop("status")
            return self._store(key, desired, live)
        if live is None:
            raise ApiError(404, "NotFound", f"{plural} {name} not found")
        expected = ((body or {}).get("metadata") or {}).get("resourceVersion")
        if expected is not None and expected != live["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", f"{plural} {name} was modified (resourceVersion {expected})")
        if sub == "status":
            updated = copy.deepcopy(live)
            status = merge_patch(live.get("status"), (body or {}).get("status"))
            if status:
                updated["status"] = status
            else:
                updated.pop("status", None)
        else:
            patch = copy.deepcopy(body or {})
            patch.pop("status", None)
            (patch.get("metadata") or {}).pop("resourceVersion", None)
            updated = merge_patch(live, patch)
        return self._store(key, updated, live)

    def _store(self, key: Key, obj: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
        self._stamp(obj, old)
        self._objects[key] = obj
        self.changed.set()
        return copy.deepcopy(obj)

    def _stamp(self, obj: dict[str, Any], old: dict[str, Any] | None) -> None:
        meta = obj.setdefault("metadata", {})
        old_meta = (old or {}).get("metadata") or {}
        meta["uid"] = old_meta.get("uid") or meta.get("uid") or str(uuid.uuid4())
        meta["creationTimestamp"] = old_meta.get("creationTimestamp") or rfc3339(
            datetime.datetime.now(datetime.UTC)
        )
        if old is None:
            meta["generation"] = int(meta.get("generation") or 1)
        else:
            changed = old.get("spec") != obj.get("spec")
            meta["generation"] = int(old_meta.get("generation") or 1) + (1 if changed else 0)
        meta["resourceVersion"] = str(next(self._versions))
