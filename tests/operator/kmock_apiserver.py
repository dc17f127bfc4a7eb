"""A Kubernetes API on 127.0.0.1 for the operator tests: kmock's emulator plus what a real API
server does and kopf or the operator rely on.

kmock 0.8's ``KubernetesEmulator`` stores objects and streams watch events, but as measured:

- it sets no ``uid``/``resourceVersion``/``generation``/``creationTimestamp`` (owner references
  need the uid; kopf's JSON-patch writes test ``resourceVersion``);
- it never answers 409 for a stale ``resourceVersion`` nor 422 for a failed JSON-patch test;
- it ignores ``labelSelector`` on lists and watches;
- a PATCH on ``/status`` or on the object changes both (no status-subresource isolation);
- PATCH only merges: no server-side apply (and no create-on-apply), no JSON-patch tests;
- it has no garbage collector (owner references delete nothing) and no controllers (a
  Deployment never gets pods or ``readyReplicas``: tests set its status like a controller would);
- discovery reports the core group as ``/v1``; ``GET /api/v1/namespaces`` answers 500, so the
  operator runs with explicit namespaces.

``ApiServer`` fills those gaps (except controllers and namespaces) by rewriting each write into
the merge patch kmock understands, and records every write for the tests to count.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import json
import threading
import urllib.error
import urllib.request
import uuid
import warnings
from pathlib import Path
from typing import Any

import attrs
import jsonpatch
import kmock
import yaml

from kvpilot.operator.api.patch import merge_patch

WRITE_ACTIONS = {kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE}
RBAC_VERBS = {
    (kmock.action.FETCH, "GET"): "get",
    (kmock.action.LIST, "GET"): "list",
    (kmock.action.WATCH, "GET"): "watch",
    (kmock.action.CREATE, "POST"): "create",
    (kmock.action.UPDATE, "PATCH"): "patch",
    (kmock.action.DELETE, "DELETE"): "delete",
}


def merge_diff(old: Any, new: Any) -> Any:
    """The JSON merge patch (RFC 7386) that turns ``old`` into ``new``."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    patch = {key: None for key in old if key not in new}
    for key, value in new.items():
        if key not in old:
            patch[key] = value
        elif old[key] != value:
            patch[key] = merge_diff(old[key], value)
    return patch


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


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ApiServer(kmock.KubernetesEmulator):
    """kmock's Kubernetes emulator with the API server behaviours listed in the module docstring."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.versions = itertools.count(1)
        self.write_lock = asyncio.Lock()
        self.writes: list[tuple[str, str]] = []  # (method, path) of every write request
        self.verbs: set[tuple[str, str, str]] = set()  # (group, resource, verb) the operator used

    def has_status(self, resource: Any) -> bool:
        return resource in self.resources and "status" in self.resources[resource].subresources

    async def _handle(self, request: kmock.Request) -> Any:
        # kmock keeps every request and finds the current one by a linear scan: keep the log short.
        if len(self._requests) > 512:
            del self._requests[:-64]
        self._record_verb(request)
        if request.resource is None or request.action not in WRITE_ACTIONS:
            return await super()._handle(request)
        if request.resource not in self.resources:  # e.g. a CRD that is not installed
            return await self._render_error(kmock.KubernetesResourceNotFoundError())
        async with self.write_lock:
            self.writes.append((request.method.value, request.url.path))
            try:
                rewritten = self._rewrite(request)
            except kmock.KubernetesError as exc:
                return await self._render_error(exc)
            if rewritten is not request:
                # kmock matches reactions against its log of requests by identity: log the rewrite.
                self._requests[next(i for i, r in enumerate(self._requests) if r is request)] = rewritten
                request = rewritten
            response = await super()._handle(request)
            await self._collect_garbage()  # also catches children created for an owner already gone
            return response

    def _record_verb(self, request: kmock.Request, verb: str | None = None) -> None:
        """Remember (group, resource[/subresource], RBAC verb) of requests not made by the tests."""
        agent = next((v for k, v in request.headers.items() if k.lower() == "user-agent"), "")
        if request.resource is None or request.resource.plural is None or request.action is None:
            return  # discovery
        if agent.startswith("Python-urllib"):
            return
        verb = verb or RBAC_VERBS.get((request.action, request.method.value), "unknown")
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        self.verbs.add((request.resource.group, resource, verb))

    def _current(self, request: kmock.Request) -> dict[str, Any] | None:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return copy.deepcopy(self.objects[key].raw)

    def _stamp_new(self, request: kmock.Request, obj: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if request.namespace:
            meta["namespace"] = request.namespace
        meta.update(
            uid=str(uuid.uuid4()),
            resourceVersion=str(next(self.versions)),
            generation=1,
            creationTimestamp=_now(),
        )
        if self.has_status(request.resource):
            obj.pop("status", None)  # status is written through /status only
        return obj

    def _rewrite(self, request: kmock.Request) -> kmock.Request:
        """Turn a write into what kmock applies: a create of a stamped object or a merge diff."""
        if request.action == kmock.action.CREATE:
            return attrs.evolve(request, data=self._stamp_new(request, request.data or {}))
        if request.action != kmock.action.UPDATE or request.subresource not in (None, "status"):
            return request
        current = self._current(request)
        content_type = next((v for k, v in request.headers.items() if k.lower() == "content-type"), "")
        data = request.data
        if "apply-patch" in content_type:
            if current is None:  # server-side apply creates missing objects (RBAC: create too)
                self._record_verb(request, "create")
                return attrs.evolve(request, action=kmock.action.CREATE, data=self._stamp_new(request, data))
            new = copy.deepcopy(current)
            for key, value in data.items():
                if key != "metadata" and key != "status":
                    new[key] = copy.deepcopy(value)
            applied_meta = data.get("metadata") or {}
            for key in ("labels", "annotations"):
                new["metadata"][key] = {
                    **(current["metadata"].get(key) or {}),
                    **(applied_meta.get(key) or {}),
                }
            if "ownerReferences" in applied_meta:
                new["metadata"]["ownerReferences"] = applied_meta["ownerReferences"]
        elif current is None:
            raise kmock.KubernetesObjectNotFoundError()
        elif "json-patch" in content_type:
            try:
                new = jsonpatch.apply_patch(current, data)
            except (jsonpatch.JsonPatchTestFailed, jsonpatch.JsonPatchConflict) as exc:
                raise kmock.KubernetesError(status=422, reason="Invalid", message=str(exc)) from exc
        else:
            wanted_version = ((data or {}).get("metadata") or {}).get("resourceVersion")
            if wanted_version is not None and wanted_version != current["metadata"]["resourceVersion"]:
                raise kmock.KubernetesError(
                    status=409,
                    reason="Conflict",
                    message="the object has been modified; please apply your changes to the latest version",
                )
            new = merge_patch(current, data)
        if self.has_status(request.resource):
            if request.subresource == "status":
                new = {**copy.deepcopy(current), "status": new.get("status")}
            else:
                new["status"] = current.get("status")
        for key in ("uid", "name", "namespace", "creationTimestamp", "generation", "resourceVersion"):
            new["metadata"][key] = current["metadata"].get(key)
        new = {k: v for k, v in new.items() if v is not None}
        if new == current:
            return attrs.evolve(request, action=kmock.action.FETCH)  # a no-op write changes nothing
        if {k: v for k, v in new.items() if k not in ("metadata", "status")} != {
            k: v for k, v in current.items() if k not in ("metadata", "status")
        }:
            new["metadata"]["generation"] = current["metadata"]["generation"] + 1
        new["metadata"]["resourceVersion"] = str(next(self.versions))
        return attrs.evolve(request, data=merge_diff(current, new))

    async def _collect_garbage(self) -> None:
        """Background cascading deletion: drop objects whose owners are all gone."""
        while True:
            live = {key: obj.raw for key, obj in self.objects.items() if not obj.deleted}
            uids = {raw["metadata"].get("uid") for raw in live.values()}
            orphans = [
                (key, raw)
                for key, raw in live.items()
                if raw["metadata"].get("ownerReferences")
                and all(ref.get("uid") not in uids for ref in raw["metadata"]["ownerReferences"])
            ]
            if not orphans:
                return
            for key, raw in orphans:
                self.objects[key].delete()
                await self._buses[key[0]].put({"type": "DELETED", "object": raw})

    async def _serve_list(self, request: kmock.Request) -> Any:
        result = await super()._serve_list(request)
        selector = request.params.get("labelSelector")
        if selector:
            result["items"] = [item for item in result["items"] if matches_selector(item, selector)]
        result["metadata"]["resourceVersion"] = str(next(self.versions))
        return result

    async def _serve_watch(self, request: kmock.Request) -> Any:
        selector = request.params.get("labelSelector")
        async for item in super()._serve_watch(request):
            if (
                selector
                and isinstance(item, dict)
                and not matches_selector(item.get("object") or {}, selector)
            ):
                continue
            yield item

    async def _serve_version(self, request: kmock.Request) -> Any:
        result = await super()._serve_version(request)
        result["groupVersion"] = result["groupVersion"].lstrip("/")  # the core group is "v1"
        for entry in result["resources"]:
            if "/" in entry["name"]:  # subresources carry no short names or categories
                entry.update(shortNames=[], categories=[], verbs=["get", "patch", "update"])
        return result


def register_crd(server: ApiServer, crd: dict[str, Any]) -> None:
    """Make a CustomResourceDefinition discoverable, as the API server does once it is installed."""
    names = crd["spec"]["names"]
    for version in crd["spec"]["versions"]:
        resource = f"{crd['spec']['group']}/{version['name']}/{names['plural']}"
        server.resources[resource] = kmock.ResourceInfo(
            kind=names["kind"],
            singular=names["singular"],
            namespaced=crd["spec"]["scope"] == "Namespaced",
            shortnames=set(names.get("shortNames", [])),
            categories=set(names.get("categories", [])),
            subresources=set(version.get("subresources", {})),
            verbs={"create", "delete", "get", "list", "patch", "update", "watch"},
        )


class ApiServerThread:
    """Runs an ``ApiServer`` on 127.0.0.1 in a background event loop; a tiny sync client for tests."""

    def __init__(self, crd_path: Path) -> None:
        self.crd = yaml.safe_load(crd_path.read_text())
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kmock", daemon=True)
        self.server: ApiServer | None = None
        self._http: kmock.Server | None = None
        self.url = ""

    def __enter__(self) -> ApiServerThread:
        self.thread.start()
        self._call(self._start())
        return self

    def __exit__(self, *exc: object) -> None:
        self._call(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)

    def _call(self, coro: Any, timeout: float = 10) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self) -> None:
        self.server = ApiServer()
        with warnings.catch_warnings():  # kmock 0.8 reads its bundled data with a deprecated call
            warnings.simplefilter("ignore", DeprecationWarning)
            self.server.resources.load_bundled()
        register_crd(self.server, self.crd)
        await self.server.__aenter__()
        self._http = kmock.Server(self.server, host="127.0.0.1")
        await self._http.__aenter__()
        self.url = str(self._http.url).rstrip("/")

    async def _stop(self) -> None:
        await self._http.__aexit__(None, None, None)
        await self.server.__aexit__(None, None, None)

    def kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """Write a kubeconfig that points at this server (and at nothing else)."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "kmock", "cluster": {"server": self.url}}],
            "users": [{"name": "kmock", "user": {"token": "test-token"}}],
            "contexts": [
                {"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": namespace}}
            ],
            "current-context": "kmock",
        }
        path.write_text(yaml.safe_dump(config))
        return path

    @property
    def writes(self) -> list[tuple[str, str]]:
        return list(self.server.writes)

    @property
    def verbs(self) -> set[tuple[str, str, str]]:
        return set(self.server.verbs)

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> Any:
        """One HTTP request; returns the decoded body, or raises urllib.error.HTTPError."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        req.add_header("Content-Type", content_type)
        with urllib.request.urlopen(req, timeout=10) as response:
            return json.loads(response.read() or b"{}")

    def get(self, path: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", path)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise

    def create(self, collection_path: str, obj: dict[str, Any]) -> dict[str, Any]:
        return self.request("POST", collection_path, obj)

    def merge_patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self.request("PATCH", path, patch, "application/merge-patch+json")

    def delete(self, path: str) -> Any:
        return self.request("DELETE", path)
