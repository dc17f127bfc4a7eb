"""A Kubernetes API on 127.0.0.1 for the operator tests: kmock's emulator plus what a real API
server does and kopf or the operator rely on.

kmock 0.8's ``KubernetesEmulator`` stores objects and streams watch events, but as measured:

- it sets no ``uid``/``resourceVersion``/``generation``/``creationTimestamp`` (owner references
  need the uid; kopf's JSON-patch writes test ``resourceVersion``);
- it never answers 409 for a stale ``resourceVersion`` nor 422 for a failed JSON-patch test;
- it ignores ``labelSelector`` on lists and watches;
- a PATCH on ``/status`` or on the object changes both (no status-subresource isolation);
- PATCH only merges: no server-side apply (and no create-on-apply), no JSON-patch tests, no
  ``managedFields`` (``kmock_fields`` models field ownership);
- no CRD schema on writes: no validation, pruning, defaulting or CEL rules (``crd_schema`` runs them:
  422 naming each field path);
- watches replay everything, ignore ``resourceVersion``, never end and never send 410 Gone nor
  bookmarks (``kmock_watch``);
- it has no garbage collector (owner references delete nothing) and no controllers (a
  Deployment never gets pods or ``readyReplicas``: tests set its status like a controller would);
- discovery reports the core group as ``/v1``; ``GET /api/v1/namespaces`` answers 500, so the
  operator runs with explicit namespaces.

``ApiServer`` fills those gaps (except controllers and namespaces) by rewriting each write into
the merge patch kmock understands, and records every write (and every read the operator
makes) for the tests to count.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import datetime
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
from tests.operator import kmock_fields as fields
from tests.operator import kmock_watch as watching
from tests.operator.crd_schema import admit

WRITE_ACTIONS = {kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE}
RBAC_VERBS = {
    (kmock.action.FETCH, "GET"): "get",
    (kmock.action.LIST, "GET"): "list",
    (kmock.action.WATCH, "GET"): "watch",
    (kmock.action.CREATE, "POST"): "create",
    (kmock.action.UPDATE, "PATCH"): "patch",
    (kmock.action.DELETE, "DELETE"): "delete",
}


def _from_tests(request: kmock.Request) -> bool:
    """Requests of the tests' own client (urllib), as opposed to the operator's (aiohttp)."""
    agent = next((v for k, v in request.headers.items() if k.lower() == "user-agent"), "")
    return agent.startswith("Python-urllib")


def _field_manager(request: kmock.Request) -> str:
    """The ``fieldManager`` parameter, else the user agent's product, as the API server derives it."""
    if request.params.get("fieldManager"):
        return request.params["fieldManager"]
    agent = next((v for k, v in request.headers.items() if k.lower() == "user-agent"), "")
    return agent.split("/", 1)[0] or "unknown"


def _check_version(obj: dict[str, Any] | None, current: dict[str, Any]) -> None:
    """409 when ``obj`` carries a resourceVersion other than the live one (optimistic concurrency)."""
    wanted = ((obj or {}).get("metadata") or {}).get("resourceVersion")
    if wanted is not None and wanted != current["metadata"]["resourceVersion"]:
        raise kmock.KubernetesError(
            status=409,
            reason="Conflict",
            message="the object has been modified; please apply your changes to the latest version",
        )


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class VersionCounter:
    """The server's resourceVersion sequence: ``next()`` issues one; ``latest`` is the last issued."""

    def __init__(self) -> None:
        self.latest = 0

    def __iter__(self) -> VersionCounter:
        return self

    def __next__(self) -> int:
        self.latest += 1
        return self.latest


class ApiServer(kmock.KubernetesEmulator):
    """kmock's Kubernetes emulator with the API server behaviours listed in the module docstring."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.versions = VersionCounter()
        self.write_lock = asyncio.Lock()
        self.writes: list[tuple[str, str]] = []  # (method, path) of every write request
        self.verbs: set[tuple[str, str, str]] = set()  # (group, resource, verb) the operator used
        self.reads: collections.Counter[str] = collections.Counter()  # path -> GETs the operator made
        # (group, version, plural) -> the CRD schema writes of that resource must pass
        self.schemas: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.history = watching.WatchHistory()

    def has_status(self, resource: Any) -> bool:
        return resource in self.resources and "status" in self.resources[resource].subresources

    async def _handle(self, request: kmock.Request) -> Any:
        # kmock keeps every request and finds the current one by a linear scan: keep the log short.
        if len(self._requests) > 512:
            del self._requests[:-64]
        self._record_verb(request)
        if request.action in (kmock.action.FETCH, kmock.action.LIST) and not _from_tests(request):
            self.reads[request.url.path] += 1
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
        if request.resource is None or request.resource.plural is None or request.action is None:
            return  # discovery
        if _from_tests(request):
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
        manager = _field_manager(request)
        if request.action == kmock.action.CREATE:
            created = self._admit(request, self._stamp_new(request, request.data or {}))
            return attrs.evolve(request, data=fields.record_update(None, created, manager))
        if request.action != kmock.action.UPDATE or request.subresource not in (None, "status"):
            return request
        current = self._current(request)
        content_type = next((v for k, v in request.headers.items() if k.lower() == "content-type"), "")
        data = request.data
        if "apply-patch" in content_type:
            if "fieldManager" not in request.params:
                raise kmock.KubernetesError(
                    status=400, reason="BadRequest", message="PATCH with apply-patch requires a fieldManager"
                )
            if current is not None:
                _check_version(data, current)
            try:
                new = fields.apply(current, data, manager, force=request.params.get("force") == "true")
            except fields.FieldConflict as exc:
                causes = [
                    {
                        "reason": "FieldManagerConflict",
                        "field": ".".join(path),
                        "message": f"conflict with {m}",
                    }
                    for path, m in exc.conflicts
                ]
                raise kmock.KubernetesError(
                    status=409, reason="Conflict", message=str(exc), details={"causes": causes}
                ) from exc
            except fields.KeyedListNotModelled as exc:  # a test relying on it fails loudly
                raise kmock.KubernetesError(status=500, reason="InternalError", message=str(exc)) from exc
            if current is None:  # server-side apply creates missing objects (RBAC: create too)
                self._record_verb(request, "create")
                created = self._admit(request, self._stamp_new(request, new))
                return attrs.evolve(request, action=kmock.action.CREATE, data=created)
        elif current is None:
            raise kmock.KubernetesObjectNotFoundError()
        elif "json-patch" in content_type:
            try:
                new = jsonpatch.apply_patch(current, data)
            except (jsonpatch.JsonPatchTestFailed, jsonpatch.JsonPatchConflict) as exc:
                raise kmock.KubernetesError(status=422, reason="Invalid", message=str(exc)) from exc
            _check_version(new, current)
        else:
            _check_version(data, current)
            new = merge_patch(current, data)
        if self.has_status(request.resource):
            if request.subresource == "status":
                new = {**copy.deepcopy(current), "status": new.get("status")}
            else:
                new["status"] = current.get("status")
        for key in ("uid", "name", "namespace", "creationTimestamp", "generation", "resourceVersion"):
            new["metadata"][key] = current["metadata"].get(key)
        new = self._admit(request, {k: v for k, v in new.items() if v is not None})
        if "apply-patch" not in content_type:
            new = fields.record_update(current, new, manager)
        if new == current:
            return attrs.evolve(request, action=kmock.action.FETCH)  # a no-op write changes nothing
        if {k: v for k, v in new.items() if k not in ("metadata", "status")} != {
            k: v for k, v in current.items() if k not in ("metadata", "status")
        }:
            new["metadata"]["generation"] = current["metadata"]["generation"] + 1
        new["metadata"]["resourceVersion"] = str(next(self.versions))
        return attrs.evolve(request, data=fields.merge_diff(current, new))

    def _admit(self, request: kmock.Request, obj: dict[str, Any]) -> dict[str, Any]:
        """A custom resource as stored (pruned, defaulted); 422 naming each failing field path."""
        resource = request.resource
        schema = self.schemas.get((resource.group, resource.version, resource.plural))
        if schema is None:
            return obj
        strict = request.params.get("fieldValidation") == "Strict"
        stored, errors = admit(obj, schema, strict=strict)
        if errors:
            name = (obj.get("metadata") or {}).get("name")
            kind = obj.get("kind") or resource.plural
            causes = [
                {"reason": "FieldValueInvalid", "field": e.split(": ", 1)[0], "message": e} for e in errors
            ]
            raise kmock.KubernetesError(
                status=422,
                reason="Invalid",
                message=f'{kind}.{resource.group} "{name}" is invalid: ' + "; ".join(errors),
                details={"name": name, "group": resource.group, "kind": kind, "causes": causes},
            )
        return stored

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
            result["items"] = [item for item in result["items"] if watching.matches_selector(item, selector)]
        result["metadata"]["resourceVersion"] = str(next(self.versions))
        return result

    async def _serve_watch(self, request: kmock.Request) -> Any:
        selector = request.params.get("labelSelector")

        def matches(obj: dict[str, Any]) -> bool:
            return not selector or watching.matches_selector(obj, selector)

        info = self.resources[request.resource] if request.resource in self.resources else None
        group, version = request.resource.group, request.resource.version
        template = {
            "apiVersion": f"{group}/{version}" if group else version,
            "kind": getattr(info, "kind", None),
        }
        stream = super()._serve_watch(request)
        async for item in watching.serve(
            stream,
            request.params,
            request.url.path,
            self.history,
            matches,
            self.settled_version,
            template,
            self.write_lock,
        ):
            yield item

    async def settled_version(self) -> int:
        """The newest resourceVersion of a finished write: its watch events are on kmock's bus (a write
        stamps its version and publishes its events under the write lock)."""
        async with self.write_lock:
            return self.versions.latest

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
        server.schemas[(crd["spec"]["group"], version["name"], names["plural"])] = version["schema"][
            "openAPIV3Schema"
        ]


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

    def expire_watches(self) -> int:
        """Compact the watch history and end every open watch (as an API server restart does):
        a client that reconnects from a version it saw before gets 410 Gone. Returns the first
        version still served."""

        async def expire() -> int:
            version = next(self.server.versions)
            self.server.history.expire(version)
            return version

        return self._call(expire())

    def set_watch_behaviour(
        self, *, max_timeout_s: float | None = None, bookmark_interval_s: float | None = None
    ) -> None:
        """The server's own watch timeout and bookmark interval (None: off) for the watches from now."""

        async def configure() -> None:
            self.server.history.max_timeout_s = max_timeout_s
            self.server.history.bookmark_interval_s = bookmark_interval_s

        self._call(configure())

    def sent(self, path: str) -> list[tuple[str, str]]:
        """(type, resourceVersion) of every event the watches of ``path`` delivered, in order."""
        return [
            (kind, version) for watched, kind, version in list(self.server.history.sent) if watched == path
        ]

    def ended(self, path: str) -> list[str]:
        """Why the server ended each watch of ``path`` it ended (``timeout`` or ``expired``)."""
        return [why for watched, why in list(self.server.history.ended) if watched == path]

    def watches(self, path: str) -> list[str | None]:
        """The ``resourceVersion`` of every watch of ``path`` started so far (None: from now)."""
        return [since for watched, since in list(self.server.history.started) if watched == path]

    def reads(self, path: str) -> int:
        """How many GETs (one object or a list, no watches) the operator has made of ``path``."""
        return self.server.reads[path]

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
