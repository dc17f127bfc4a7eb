"""The remediation loop: every ``scrape_interval``, read the engines' metrics and act on them (thin I/O).

One tick::

    LIST InferenceServices, LIST engine pods (one label selector)     per namespace in scope, or cluster-wide
    classify each service's pods (pods.classify: current template? ready? failing?)
    scrape every ready pod of the current configuration at once       (scrape.Scraper: short timeouts)
    append to the per-pod series (window.PodSeries), record them      (--record FILE)
    per InferenceService, under its reconcile lock and on a fresh read:
        remediation.evaluate(isvc, window, now) -> Decision + status patch + Events
        write the status (with resourceVersion: a concurrent change means "next tick")
        Auto, on a change: reconcile() re-renders the children from the new status.effective

Why a loop of its own rather than kopf timers: kopf puts a finalizer on every object that has a timer
(deleting an InferenceService would then hang whenever the operator is down), and one loop scrapes all
pods concurrently with two LIST calls per scope instead of one timer task and one pod listing per
object. Metric series live in memory: after an operator restart the policy waits for a full window.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvpilot.operator.api import names
from kvpilot.operator.render.builders import build_deployment
from kvpilot.operator.api.effective import resolve_effective
from kvpilot.operator.kube import ApiError, KubeClient, object_path
from kvpilot.operator.remediation.pods import PodSet, classify
from kvpilot.operator.remediation.policy import APPLY, RemediationSettings
from kvpilot.operator.reconcile.reconciler import reconcile
from kvpilot.operator.remediation.evaluate import evaluate
from kvpilot.operator.remediation.scrape import Recorder, Scraper
from kvpilot.operator.api.validation import validate
from kvpilot.operator.remediation.window import MetricsParseError, PodSeries, parse_scrape, summarize

ENGINE_POD_SELECTOR = f"{names.LABEL_MANAGED_BY}={names.MANAGED_BY},{names.LABEL_COMPONENT}={names.COMPONENT}"
STALE_INTERVALS = 3.0  # a pod's metrics are stale after this many scrape intervals without an answer

LOG = logging.getLogger("kvpilot.operator.remediation.evaluate")

# (isvc, type, reason, message) -> posts an Event; (namespace, name) -> the object's write lock.
PostEvent = Callable[[dict, str, str, str], Awaitable[None]]
LockFor = Callable[[str, str], asyncio.Lock]


@dataclasses.dataclass(frozen=True)
class AutotunerOptions:
    """How often and how patiently to scrape, and where to record (``kvpilot operator`` flags)."""

    namespaces: tuple[str, ...] = ()
    clusterwide: bool = False
    scrape_interval: float = 15.0
    scrape_timeout: float = 3.0
    record: str | None = None
    service_monitors: bool = False


def pod_key(pod: dict[str, Any]) -> str:
    """The series key of a pod (as ``pods.Target.key``): a recreated pod starts a new series."""
    meta = pod["metadata"]
    return f"{meta.get('namespace', '')}/{meta['name']}/{meta.get('uid', '')}"


@dataclasses.dataclass
class _Service:
    isvc: dict[str, Any]
    pods: PodSet
    has_pods: bool


class Autotuner:
    """Scrapes engine pods and runs remediation for every InferenceService in scope."""

    def __init__(
        self,
        kube: KubeClient,
        options: AutotunerOptions,
        lock_for: LockFor,
        post_event: PostEvent,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.kube = kube
        self.options = options
        self.lock_for = lock_for
        self.post_event = post_event
        self.clock = clock
        self.scraper = Scraper(timeout_s=options.scrape_timeout, clock=clock)
        self.recorder = Recorder(options.record) if options.record else None
        self.series: dict[str, PodSeries] = {}
        self._unrendered: set[tuple[str, str]] = set()  # changed status whose children await a re-render

    @property
    def stale_after_s(self) -> float:
        return STALE_INTERVALS * self.options.scrape_interval

    async def close(self) -> None:
        """Release the HTTP session and the recording file."""
        await self.scraper.close()
        if self.recorder is not None:
            self.recorder.close()

    async def run_forever(self, logger: Any = LOG) -> None:
        """Tick every ``scrape_interval`` seconds (a slow tick delays the next, never overlaps it)."""
        while True:
            started = time.monotonic()
            try:
                await self.tick(logger)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # one bad tick must not end remediation for good
                logger.warning(f"remediation tick failed: {exc!r}")
            await asyncio.sleep(max(0.0, self.options.scrape_interval - (time.monotonic() - started)))

    async def _list(self, api_version: str, kind: str, selector: str | None = None) -> list[dict]:
        scopes = [None] if self.options.clusterwide else list(self.options.namespaces)
        params = {"labelSelector": selector} if selector else None
        items: list[dict] = []
        for namespace in scopes:
            listing = await self.kube.request("GET", object_path(api_version, kind, namespace), params=params)
            for item in listing.get("items") or []:
                item.setdefault("apiVersion", api_version)
                item.setdefault("kind", kind)
                items.append(item)
        return items

    def _services(self, isvcs: list[dict], pods: list[dict], now: float) -> list[_Service]:
        by_owner: dict[tuple[str, str], list[dict]] = {}
        for pod in pods:
            meta = pod["metadata"]
            owner = (meta.get("labels") or {}).get(names.LABEL_ISVC)
            if owner:
                by_owner.setdefault((meta.get("namespace", ""), owner), []).append(pod)
        services = []
        for isvc in isvcs:
            meta = isvc["metadata"]
            if meta.get("deletionTimestamp") or validate(isvc):
                continue  # being deleted, or invalid (the reconciler reports why)
            template = build_deployment(isvc, resolve_effective(isvc))["spec"]["template"]
            template_hash = template["metadata"]["labels"][names.LABEL_TEMPLATE_HASH]
            owned = by_owner.get((meta.get("namespace", ""), meta["name"]), [])
            services.append(_Service(isvc, classify(owned, template_hash, now), bool(owned)))
        return services

    async def tick(self, logger: Any = LOG) -> None:
        """One round: list, scrape, evaluate and act for every InferenceService in scope."""
        tick = self.clock()
        isvcs = await self._list(names.API_VERSION, names.KIND)
        pods = await self._list("v1", "Pod", ENGINE_POD_SELECTOR) if isvcs else []
        services = self._services(isvcs, pods, tick)
        targets = [t for service in services for t in service.pods.targets]
        results = await self.scraper.scrape(targets)
        owner_of = {t.key: service.isvc for service in services for t in service.pods.targets}
        live_keys = {pod_key(p) for p in pods}
        for key in [k for k in self.series if k not in live_keys]:
            del self.series[key]  # the pod is gone
        for result in results:
            isvc = owner_of[result.target.key]
            retention = RemediationSettings.from_spec(isvc["spec"]).window_s + 2 * self.stale_after_s
            series = self.series.setdefault(result.target.key, PodSeries(result.target.name, retention))
            series.retention_s = retention
            if self.recorder is not None:
                self.recorder.write(result, tick, isvc)
            if result.error is not None:
                series.fail(result.time, result.error)
                continue
            try:
                scrape = parse_scrape(result.text, result.time)
            except MetricsParseError as exc:
                series.fail(result.time, str(exc))
                continue
            if scrape.missing:
                series.fail(result.time, f"partial scrape, lacks {', '.join(scrape.missing)}")
            else:
                series.add(scrape)
        if self.recorder is not None:
            for service in services:
                for pod in service.pods.waiting:
                    self.recorder.write_not_ready(pod, tick, service.isvc)
                for failing in service.pods.failing:
                    pod, _, why = failing.partition(": ")
                    self.recorder.write_not_ready(pod, tick, service.isvc, why)
        now = self.clock()
        for service in services:
            try:
                await self._evaluate(service, now, logger)
            except ApiError as exc:
                meta = service.isvc["metadata"]
                logger.warning(f"remediation of {meta['namespace']}/{meta['name']} failed: {exc}")

    async def _evaluate(self, service: _Service, now: float, logger: Any) -> None:
        listed = service.isvc
        meta = listed["metadata"]
        settings = RemediationSettings.from_spec(listed["spec"])
        window = summarize(
            {t.name: self.series[t.key] for t in service.pods.targets if t.key in self.series},
            now=now,
            window_s=settings.window_s,
            stale_after_s=self.stale_after_s,
            expected_replicas=resolve_effective(listed).replicas,
            problems=service.pods.problems(),
            failing=service.pods.failing,
        )
        namespace, name = meta["namespace"], meta["name"]
        async with self.lock_for(namespace, name):
            path = object_path(names.API_VERSION, names.KIND, namespace, name)
            isvc = await self.kube.get(path)
            if isvc is None or isvc.get("spec") != listed.get("spec"):
                return  # deleted or edited since the listing: the next tick sees the new configuration
            if (namespace, name) in self._unrendered:
                await self._render(isvc, logger)  # a change of an earlier tick still to reach the children
            decision, update = evaluate(isvc, window, now, observed_pods=service.has_pods)
            if update.patch is None:
                return
            body = {
                "metadata": {"resourceVersion": isvc["metadata"]["resourceVersion"]},
                "status": update.patch,
            }
            try:
                live = await self.kube.merge_patch(path + "/status", body)
            except ApiError as exc:
                if exc.status == 409:
                    return  # written concurrently: evaluate again on the next tick
                raise
            if decision.is_change:
                logger.info(f"{namespace}/{name}: {decision.action} {decision.lever}: {decision.reason}")
            for type_, reason, message in update.events:
                await self.post_event(live, type_, reason, message)
            if decision.action == APPLY:
                await self._render(live, logger)

    async def _render(self, isvc: dict[str, Any], logger: Any) -> None:
        """Re-render the children from ``status.effective``; a failed pass is retried next tick."""
        meta = isvc["metadata"]
        key = (meta["namespace"], meta["name"])
        isvc.setdefault("apiVersion", names.API_VERSION)
        isvc.setdefault("kind", names.KIND)

        async def emit(type_: str, reason: str, message: str) -> None:
            await self.post_event(isvc, type_, reason, message)

        self._unrendered.add(key)
        outcome = await reconcile(
            self.kube, isvc, emit, service_monitors=self.options.service_monitors, announce=False
        )
        self._unrendered.discard(key)
        for line in outcome.written:
            logger.info(f"{key[0]}/{key[1]}: {line} (remediation)")
