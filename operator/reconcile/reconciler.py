"""Reconciling an InferenceService: one pass (:func:`reconcile`: build, apply what changed, write
status) and the :class:`Reconciler` that runs passes one at a time per object on a fresh read.

Idempotent: a child is written only when its desired hash differs from the live object's, or when
any field the operator renders drifted on the live object (``kubectl set image``, edited args or env,
a hand-scaled Deployment: see :mod:`~kvpilot.operator.reconcile.drift`), and status only when an
owned field changed, so a pass over an unchanged object performs reads only. No kopf and no HTTP
client here: the API client is injected (``api.rest.Kube``), and the kopf handlers and the local
platform translate the :class:`Outcome` into their errors and logs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from kvpilot.operator.api import names
from kvpilot.operator.api.platform import DEFAULT_PLATFORM, Platform
from kvpilot.operator.api.rest import ApiError, Kube, object_path, path_of
from kvpilot.operator.api.settings import Settings, resolve
from kvpilot.operator.api.timefmt import rfc3339
from kvpilot.operator.reconcile.drift import is_controlled_by, needs_write
from kvpilot.operator.reconcile.status import (
    blocked_message,
    desired_status,
    spec_invalid_message,
    status_patch,
)
from kvpilot.operator.render.builders import (
    build_children,
    build_event,
    build_service_monitor,
    selector_string,
)
from kvpilot.operator.render.routing import CRD_KINDS, unwanted_children

# (type, reason, message) -> posts a Kubernetes Event about the InferenceService.
EmitFn = Callable[[str, str, str], Awaitable[None] | None]
# (isvc, type, reason, message) -> posts a Kubernetes Event about ``isvc``.
PostEvent = Callable[[dict, str, str, str], Awaitable[None]]


@dataclasses.dataclass
class Outcome:
    """What one pass did. ``problems``: why the spec is invalid (nothing was applied).
    ``conflicts``: children that exist but belong to someone else (left untouched).
    ``written``: "Created Deployment x" / "Updated Service x" lines. ``warnings``: things the spec
    asks for that this operator cannot do (nothing else is blocked). ``unavailable``: children of a
    kind the cluster does not serve (its CRD is not installed: InferencePool, HTTPRoute, ScaledObject;
    nothing else is blocked). ``status_written``: whether the status changed. ``gone``: the
    InferenceService no longer exists."""

    problems: list[str] = dataclasses.field(default_factory=list)
    conflicts: list[str] = dataclasses.field(default_factory=list)
    written: list[str] = dataclasses.field(default_factory=list)
    forbidden: list[str] = dataclasses.field(default_factory=list)
    warnings: list[str] = dataclasses.field(default_factory=list)
    unavailable: list[str] = dataclasses.field(default_factory=list)
    status_written: bool = False
    gone: bool = False
    # The optional children (apiVersion, kind, name) the spec does not want that this pass made sure
    # are gone (None: it did not prune).
    pruned: frozenset[tuple[str, str, str]] | None = None


async def _apply_children(kube: Kube, isvc: dict[str, Any], children: list[dict], outcome: Outcome):
    deployment = None
    for desired in children:
        kind, name = desired["kind"], desired["metadata"]["name"]
        try:
            live = await kube.get(path_of(desired))
        except ApiError as exc:
            if exc.status == 404 and kind == "ServiceMonitor":
                continue  # the Prometheus Operator's CRD is not installed: nothing to scrape with
            if exc.status == 403:
                outcome.forbidden.append(f"cannot get {kind} {name}: {exc.message}")
                continue
            raise
        if live is not None and not is_controlled_by(live, isvc):
            outcome.conflicts.append(f"{kind} {name} exists and is not owned by this {names.KIND}")
            continue
        if needs_write(desired, live):
            verb = "Created" if live is None else "Updated"
            try:
                live = await kube.apply(desired)
            except ApiError as exc:
                if exc.status == 404 and kind == "ServiceMonitor":
                    continue
                if exc.status == 404 and kind in CRD_KINDS:
                    outcome.unavailable.append(
                        f"{kind} {name}: the cluster does not serve {desired['apiVersion']} {kind} "
                        f"(install {CRD_KINDS[kind]}'s CRDs); the rest of the InferenceService is reconciled"
                    )
                    continue
                if exc.status == 403:
                    outcome.forbidden.append(f"cannot apply {kind} {name}: {exc.message}")
                    continue
                raise
            outcome.written.append(f"{verb} {kind} {name}")
        if kind == "Deployment":
            deployment = live
    return deployment


async def _prune_service_monitor(kube: Kube, settings: Settings, outcome: Outcome) -> None:
    """Delete the ServiceMonitor once monitoring.serviceMonitor.enabled is turned off."""
    isvc = settings.isvc
    path = path_of(build_service_monitor(settings))
    try:
        live = await kube.get(path)
    except ApiError as exc:
        if exc.status == 404:  # the resource type itself does not exist
            return
        raise
    if live is not None and is_controlled_by(live, isvc):
        await kube.delete(path)
        outcome.written.append(f"Deleted ServiceMonitor {isvc['metadata']['name']}")


async def _prune_optional(
    kube: Kube, settings: Settings, unwanted: frozenset[tuple[str, str, str]], outcome: Outcome
) -> None:
    """Delete the children of spec.router and spec.autoscaling the spec no longer asks for (only
    those this InferenceService controls; a kind the cluster does not serve reads as absent)."""
    namespace = settings.meta.get("namespace")
    for api_version, kind, name in sorted(unwanted):
        path = object_path(api_version, kind, namespace, name)
        try:
            live = await kube.get(path)
        except ApiError as exc:
            if exc.status == 403:  # an older role without the verb: nothing of that kind was created
                continue
            raise
        if live is not None and is_controlled_by(live, settings.isvc):
            await kube.delete(path)
            outcome.written.append(f"Deleted {kind} {name}")


async def _write_status(kube: Kube, isvc: dict[str, Any], desired: dict[str, Any]) -> bool:
    patch = status_patch(isvc.get("status"), desired)
    if patch is None:
        return False
    meta = isvc["metadata"]
    body = {"metadata": {"resourceVersion": meta["resourceVersion"]}, "status": patch}
    path = object_path(names.API_VERSION, names.KIND, meta.get("namespace"), meta["name"], "status")
    await kube.merge_patch(path, body)
    return True


async def reconcile(
    kube: Kube,
    settings: Settings,
    emit: EmitFn,
    *,
    now: datetime.datetime | None = None,
    apply_children: bool = True,
    service_monitors: bool = False,
    announce: bool = True,
    pruned: frozenset[tuple[str, str, str]] | None = None,
) -> Outcome:
    """Bring the children and status of the InferenceService ``settings`` resolves (its object as last
    read) in line with its spec.

    ``apply_children=False`` only refreshes status from the live Deployment. ``service_monitors``:
    whether this operator may manage ServiceMonitors (it has the RBAC for them; otherwise it never
    touches that resource). ``announce``: post one-off warnings as Events (a spec change, not a
    periodic pass). ``pruned``: the unwanted optional children an earlier pass made sure were gone
    (``Outcome.pruned``); a periodic pass prunes only when that set has changed since, so a spec
    change whose announced pass failed is still carried out. Raises ApiError for API failures (409 on
    a stale status write included).
    """
    now = now or datetime.datetime.now(datetime.UTC)
    outcome = Outcome()
    isvc = settings.isvc
    meta = isvc["metadata"]
    if meta.get("deletionTimestamp"):
        return outcome  # being deleted: the garbage collector removes the children
    outcome.problems = list(settings.problems)
    deployment_path = object_path("apps/v1", "Deployment", meta.get("namespace"), meta["name"])
    effective = None
    deployment = None
    if outcome.problems:
        deployment = await kube.get(deployment_path)
        if deployment is not None and not is_controlled_by(deployment, isvc):
            deployment = None
        message = "; ".join(outcome.problems)
        if spec_invalid_message(isvc.get("status")) != message:
            await _emit(emit, "Warning", "InvalidSpec", message)
    else:
        effective = settings.effective
        children = build_children(settings)
        wants_monitor = any(c["kind"] == "ServiceMonitor" for c in children)
        if wants_monitor and not service_monitors:
            children = [c for c in children if c["kind"] != "ServiceMonitor"]
            outcome.warnings.append(
                "spec.monitoring.serviceMonitor.enabled is set, but the operator runs without "
                "--service-monitors (chart value rbac.serviceMonitors): no ServiceMonitor is created"
            )
        if apply_children:
            deployment = await _apply_children(kube, isvc, children, outcome)
            if service_monitors and not wants_monitor:
                await _prune_service_monitor(kube, settings, outcome)
            unwanted = frozenset(unwanted_children(settings, children))
            if announce or unwanted != pruned:
                # Removing spec.router or spec.autoscaling is a spec change, and spec changes (and
                # restarts) run announced passes; periodic passes skip these reads unless what the
                # spec wants has changed since the last prune (an announced pass that failed).
                await _prune_optional(kube, settings, unwanted, outcome)
                outcome.pruned = unwanted
        else:
            deployment = await kube.get(deployment_path)
            if deployment is not None and not is_controlled_by(deployment, isvc):
                deployment = None
        for line in outcome.written:
            await _emit(emit, "Normal", line.split(" ", 1)[0], line)
        if announce:
            for line in outcome.warnings:
                await _emit(emit, "Warning", "ServiceMonitorUnavailable", line)
            for line in outcome.unavailable:
                await _emit(emit, "Warning", "CRDMissing", line)
        if outcome.conflicts and blocked_message(isvc.get("status")) != "; ".join(outcome.conflicts):
            await _emit(emit, "Warning", "ChildConflict", "; ".join(outcome.conflicts))
        if outcome.forbidden and blocked_message(isvc.get("status")) != "; ".join(outcome.forbidden):
            await _emit(emit, "Warning", "Forbidden", "; ".join(outcome.forbidden))
    desired = desired_status(
        isvc,
        effective,
        deployment,
        outcome.problems,
        selector_string(isvc),
        now,
        conflicts=outcome.conflicts,
        forbidden=outcome.forbidden,
        desired_replicas=_autoscaled_replicas(settings, deployment),
    )
    outcome.status_written = await _write_status(kube, isvc, desired)
    return outcome


def _autoscaled_replicas(settings: Settings, deployment: dict[str, Any] | None) -> int | None:
    """Under spec.autoscaling, the replicas the autoscaler set on the Deployment (what the rollout is
    measured against); None otherwise, or before the Deployment exists."""
    if settings.problems or settings.autoscaling_kind is None or deployment is None:
        return None
    replicas = (deployment.get("spec") or {}).get("replicas")
    return int(replicas) if replicas is not None else None


async def _emit(emit: EmitFn, type_: str, reason: str, message: str) -> None:
    result = emit(type_, reason, message)
    if result is not None:
        await result


async def post_event(kube: Kube, isvc: dict, type_: str, reason: str, message: str, logger: Any) -> None:
    """Post a Kubernetes Event about ``isvc``; a failure is logged, never raised (events are best effort)."""
    now = datetime.datetime.now(datetime.UTC)
    body = build_event(isvc, type_, reason, message, rfc3339(now), uuid.uuid4().hex[:16])
    try:
        await kube.create(body)
    except ApiError as exc:
        logger.warning(f"cannot post event {reason}: {exc}")


class Reconciler:
    """Runs reconcile passes: one at a time per object, always on a fresh read of it.

    ``post_event`` posts the Events of a pass; ``service_monitors``: whether ServiceMonitors may be
    managed; ``platform``: the operator's default image and allowlists. :meth:`lock` is also the lock
    remediation takes before it writes the same object.
    """

    def __init__(
        self,
        kube: Kube,
        post_event: PostEvent,
        *,
        service_monitors: bool = False,
        platform: Platform = DEFAULT_PLATFORM,
        metrics: Any = None,
    ) -> None:
        self.kube = kube
        self.post_event = post_event
        self.service_monitors = service_monitors
        self.platform = platform
        # observability.OperatorMetrics (duck-typed: this folder imports no exporter), or None.
        self.metrics = metrics
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        # Per InferenceService: the unwanted optional children its last pruning pass removed.
        self._pruned: dict[tuple[str, str], frozenset[tuple[str, str, str]]] = {}

    def lock(self, namespace: str, name: str) -> asyncio.Lock:
        """The lock that serialises every write to one InferenceService (reconcile and remediation)."""
        return self._locks.setdefault((namespace, name), asyncio.Lock())

    async def run(self, namespace: str, name: str, logger: Any, announce: bool = False) -> Outcome:
        """Reconcile one InferenceService by name; ``Outcome.gone`` when it no longer exists.

        ``announce``: the pass follows a spec change or a (re)start, so one-off warnings are posted.
        """
        async with self.lock(namespace, name):
            isvc = await self.kube.get(object_path(names.API_VERSION, names.KIND, namespace, name))
            if isvc is None:
                self._locks.pop((namespace, name), None)
                self._pruned.pop((namespace, name), None)
                if self.metrics is not None:
                    self.metrics.forget(namespace, name)
                return Outcome(gone=True)
            outcome = await self.reconcile(resolve(isvc, self.platform), announce=announce)
        for line in outcome.written:
            logger.info(line)
        for line in outcome.forbidden:
            logger.error(f"RBAC: {line}")
        return outcome

    async def reconcile(self, settings: Settings, announce: bool = False) -> Outcome:
        """One pass over ``settings`` (a fresh read; the caller holds :meth:`lock`)."""
        isvc = settings.isvc

        async def emit(type_: str, reason: str, message: str) -> None:
            await self.post_event(isvc, type_, reason, message)

        started = time.monotonic()
        key = (isvc["metadata"].get("namespace"), isvc["metadata"]["name"])
        try:
            outcome = await reconcile(
                self.kube,
                settings,
                emit,
                service_monitors=self.service_monitors,
                announce=announce,
                pruned=self._pruned.get(key),
            )
            if outcome.pruned is not None:
                self._pruned[key] = outcome.pruned
            return outcome
        finally:
            if self.metrics is not None:
                meta = isvc["metadata"]
                self.metrics.observe_reconcile(meta["namespace"], meta["name"], time.monotonic() - started)

    async def resync_forever(self, scopes: list[str | None], interval: float, logger: Any) -> None:
        """Reconcile every InferenceService in ``scopes`` (None: all namespaces) every ``interval`` s."""
        while True:
            await asyncio.sleep(interval)
            for namespace in scopes:
                try:
                    listing = await self.kube.request(
                        "GET", object_path(names.API_VERSION, names.KIND, namespace)
                    )
                except ApiError as exc:
                    logger.warning(
                        f"resync: cannot list {names.PLURAL} in {namespace or 'all namespaces'}: {exc}"
                    )
                    continue
                for item in listing.get("items") or []:
                    meta = item["metadata"]
                    try:
                        await self.run(meta["namespace"], meta["name"], logger)
                    except Exception as exc:  # one broken object must not stop the resync of the others
                        logger.warning(f"resync of {meta['namespace']}/{meta['name']} failed: {exc!r}")
