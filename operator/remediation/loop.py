"""The remediation loop: every ``scrape_interval``, read the engines' metrics and act on them (thin I/O).

One tick::

    LIST InferenceServices, LIST engine pods (one label selector)     per namespace in scope, or cluster-wide
    resolve each InferenceService once (api.settings.resolve: defaults, validation, effective)
    classify each service's pods (pods.classify: current template? ready? failing?)
    scrape every ready pod of the current configuration at once       (scrape.Scraper: short timeouts)
    ingest into the per-pod series (series.PodSeries), record them    (--record FILE)
    per InferenceService, under its reconcile lock and on a fresh read:
        evaluate(settings, window, now) -> Decision + status patch + Events
        write the status (with resourceVersion: a concurrent change means "next tick")
        Auto, on a change: the Reconciler re-renders the children from the new status.effective

Why a loop of its own rather than kopf timers: kopf puts a finalizer on every object that has a timer
(deleting an InferenceService would then hang whenever the operator is down), and one loop scrapes all
pods concurrently with two LIST calls per scope instead of one timer task and one pod listing per
object. Metric series live in memory: after an operator restart the policy waits for a full window.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

from kvpilot.operator.api import names
from kvpilot.operator.api.live import LIVE, LIVE_FIELDS, in_force, live_values
from kvpilot.operator.api.rest import ApiError, Kube, object_path
from kvpilot.operator.api.settings import Settings, resolve
from kvpilot.operator.api.timefmt import parse_time
from kvpilot.operator.observability.metrics import OperatorMetrics
from kvpilot.operator.observability.promsource import PrometheusSource
from kvpilot.operator.options import METRICS_SOURCE_PROMETHEUS, OperatorOptions
from kvpilot.operator.plan.advise import ScrapeHistory, planner_for
from kvpilot.operator.reconcile.reconciler import Reconciler
from kvpilot.operator.remediation.decision import APPLY, REVERT, Change, history_from_status
from kvpilot.operator.remediation.evaluate import EVENT_REVERTED, evaluate, revert_update
from kvpilot.operator.remediation.live import LiveApplier, read_api_key
from kvpilot.operator.remediation.pods import PodSet, classify
from kvpilot.operator.remediation.scrape import Recorder, Scraper
from kvpilot.operator.remediation.series import PodSeries
from kvpilot.operator.remediation.window import summarize
from kvpilot.operator.render.builders import build_deployment

ENGINE_POD_SELECTOR = f"{names.LABEL_MANAGED_BY}={names.MANAGED_BY},{names.LABEL_COMPONENT}={names.COMPONENT}"
STALE_INTERVALS = 3.0  # a pod's metrics are stale after this many scrape intervals without an answer

LOG = logging.getLogger("kvpilot.operator.remediation")


def pod_key(pod: dict[str, Any]) -> str:
    """The series key of a pod (as ``pods.Target.key``): a recreated pod starts a new series."""
    meta = pod["metadata"]
    return f"{meta.get('namespace', '')}/{meta['name']}/{meta.get('uid', '')}"


@dataclasses.dataclass
class _Service:
    settings: Settings  # resolved once per tick, from the listing
    pods: PodSet
    has_pods: bool


class Autotuner:
    """Scrapes engine pods and runs remediation for every InferenceService in scope.

    ``reconciler`` provides the per-object write lock, the Event poster and the re-render after an
    Auto change, so remediation and reconcile passes never write the same object at once.
    """

    def __init__(
        self,
        kube: Kube,
        options: OperatorOptions,
        reconciler: Reconciler,
        clock: Callable[[], float] = time.time,
        metrics: OperatorMetrics | None = None,
    ) -> None:
        self.kube = kube
        self.metrics = metrics if metrics is not None else OperatorMetrics()
        self.options = options
        self.reconciler = reconciler
        self.clock = clock
        if options.metrics_source == METRICS_SOURCE_PROMETHEUS:
            # The same Results from PromQL, for clusters where the operator may not reach the pods.
            self.scraper = PrometheusSource(
                options.prometheus_url, timeout_s=options.scrape_timeout, clock=clock
            )
        else:
            self.scraper = Scraper(timeout_s=options.scrape_timeout, clock=clock)
        self.live = LiveApplier(timeout_s=options.scrape_timeout)
        self.recorder = Recorder(options.record) if options.record else None
        self.series: dict[str, PodSeries] = {}
        # What the planner simulates (spec.remediation.plan): each pod's scrapes over the longest lookback.
        self.plan_scrapes = ScrapeHistory(lookback_s=0.0)
        self._unrendered: set[tuple[str, str]] = set()  # changed status whose children await a re-render

    @property
    def stale_after_s(self) -> float:
        return STALE_INTERVALS * self.options.scrape_interval

    async def close(self) -> None:
        """Release the HTTP session and the recording file."""
        await self.scraper.close()
        await self.live.close()
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
        params = {"labelSelector": selector} if selector else None
        items: list[dict] = []
        for namespace in self.options.scopes:
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
            if meta.get("deletionTimestamp"):
                continue  # being deleted: the garbage collector removes the children
            settings = resolve(isvc, self.options.platform)
            if not settings.is_valid:
                continue  # the reconciler reports why
            template = build_deployment(settings)["spec"]["template"]
            template_hash = template["metadata"]["labels"][names.LABEL_TEMPLATE_HASH]
            owned = by_owner.get((meta.get("namespace", ""), meta["name"]), [])
            pods_of = classify(owned, template_hash, now, template)
            services.append(_Service(settings, pods_of, bool(owned)))
        return services

    async def tick(self, logger: Any = LOG) -> None:
        """One round: list, scrape, evaluate and act for every InferenceService in scope."""
        tick, started = self.clock(), time.monotonic()
        isvcs = await self._list(names.API_VERSION, names.KIND)
        # The listing is complete (a failed LIST raised): series of InferenceServices not in it go.
        self.metrics.retain(
            (i["metadata"].get("namespace", ""), i["metadata"]["name"])
            for i in isvcs
            if not i["metadata"].get("deletionTimestamp")
        )
        pods = await self._list("v1", "Pod", ENGINE_POD_SELECTOR) if isvcs else []
        services = self._services(isvcs, pods, tick)
        targets = [t for service in services for t in service.pods.targets]
        results = await self.scraper.scrape(targets)
        live_keys = {pod_key(p) for p in pods}
        for key in [k for k in self.series if k not in live_keys]:
            del self.series[key]  # the pod is gone
        self.plan_scrapes.forget(live_keys)
        # Parsing is pure Python: off the event loop, so watches and handlers keep running meanwhile.
        owner_of = {t.key: service.settings for service in services for t in service.pods.targets}
        await asyncio.to_thread(self._ingest, results, owner_of)
        now = self.clock()
        if self.recorder is not None:
            await asyncio.to_thread(self._record, results, owner_of, services, tick, now)
        for service in services:
            try:
                await self._evaluate(service, now, logger)
            except ApiError as exc:
                meta = service.settings.meta
                logger.warning(f"remediation of {meta['namespace']}/{meta['name']} failed: {exc}")
        self.metrics.observe_tick(time.monotonic() - started, self.clock())

    def _ingest(self, results: list, owner_of: dict) -> None:
        """Feed the scrapes into the per-pod series; ``owner_of``: the settings of each target's
        InferenceService (runs in a worker thread; the series are touched by nothing else while a tick
        runs)."""
        for result in results:
            settings = owner_of[result.target.key]
            retention = settings.remediation.window_s + 2 * self.stale_after_s
            series = self.series.setdefault(result.target.key, PodSeries(result.target.name, retention))
            series.retention_s = retention
            series.ingest(result.time, result.text, result.error)
            plan = settings.remediation.plan
            if plan.enabled and result.error is None and result.text is not None:
                self.plan_scrapes.lookback_s = max(self.plan_scrapes.lookback_s, plan.lookback_s)
                self.plan_scrapes.add(result.target.key, result.target.name, result.time, result.text)
            meta = settings.meta
            kind = result.kind or (result.error and "connection") or (series.problem and "invalid")
            self.metrics.observe_scrape(meta["namespace"], meta["name"], kind or None)

    def _record(
        self, results: list, owner_of: dict, services: list[_Service], tick: float, now: float
    ) -> None:
        """Append the tick to the recording, with ``now``, the time the policy judges it at (a worker
        thread: the lines are as large as the scrapes)."""
        for result in results:
            self.recorder.write(result, tick, owner_of[result.target.key].isvc, now)
        for service in services:
            isvc = service.settings.isvc
            for pod in service.pods.waiting:
                self.recorder.write_not_ready(pod, tick, isvc, evaluated=now)
            for failure in service.pods.failing:
                if not failure.ready:
                    self.recorder.write_not_ready(failure.pod, tick, isvc, failure.why, now)

    async def _evaluate(self, service: _Service, now: float, logger: Any) -> None:
        listed = service.settings
        meta = listed.meta
        window = summarize(
            {t.name: self.series[t.key] for t in service.pods.targets if t.key in self.series},
            now=now,
            window_s=listed.remediation.window_s,
            stale_after_s=self.stale_after_s,
            expected_replicas=listed.effective.replicas,
            problems=service.pods.problems(),
            failing=service.pods.failing,
        )
        namespace, name = meta["namespace"], meta["name"]
        async with self.reconciler.lock(namespace, name):
            path = object_path(names.API_VERSION, names.KIND, namespace, name)
            isvc = await self.kube.get(path)
            if isvc is None or isvc.get("spec") != listed.isvc.get("spec"):
                return  # deleted or edited since the listing: the next tick sees the new configuration
            settings = listed.with_status(isvc)
            if not settings.is_valid:
                return  # overrides the engine rejects, written since the listing: the reconciler says so
            if (namespace, name) in self._unrendered:
                # A change of an earlier tick that has not reached the children yet.
                await self._render(settings, logger)
            planner = None
            if settings.remediation.plan.enabled:
                history = history_from_status((isvc.get("status") or {}).get("remediations"))
                since = history[0].time if history else float("-inf")
                keys = [t.key for t in service.pods.targets]
                # Only the traffic the pods of the settings in force served since the last change.
                kept = functools.partial(self.plan_scrapes.scrapes, keys, since, now)
                planner = planner_for(settings, kept)
            # Off the event loop: a plan simulates (pure; this object's state is not touched meanwhile).
            decision, update = await asyncio.to_thread(
                evaluate, settings, window, now, observed_pods=service.has_pods, planner=planner
            )
            bad_data = any(
                self.series[t.key].problem is not None for t in service.pods.targets if t.key in self.series
            )
            facts = {"mid_rollout": bool(service.pods.problems()), "bad_data": bad_data}
            if update.patch is None:
                self.metrics.observe_evaluation(settings, window, decision, now, **facts)
                await self._correct_drift(settings, service.pods.targets, logger)
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
            self.metrics.observe_evaluation(settings.with_status(live), window, decision, now, **facts)
            if decision.is_change:
                logger.info(f"{namespace}/{name}: {decision.action} {decision.lever}: {decision.reason}")
            for type_, reason, message in update.events:
                await self.reconciler.post_event(live, type_, reason, message)
            if decision.action == APPLY:
                await self._render(settings.with_status(live), logger)
                change = update.change
                if change is not None and change.applied_by == LIVE:
                    await self._apply_live(settings.with_status(live), service.pods.targets, change, logger)
            else:
                await self._correct_drift(settings.with_status(live), service.pods.targets, logger)

    async def _correct_drift(self, settings: Settings, targets: tuple, logger: Any) -> None:
        """Post the live settings in force to each ready pod whose latest scrape (taken after the last
        change) reports other values in ``kvpilot_config_info``: a pod that was not ready when a live
        change was posted, one that read an older ConfigMap at start, or a change whose posts an operator
        restart cut short. A field with a live value in force must report it; one without must not
        report less than its start-up value (only a live change lowers it; the engine may round a start-up
        value up). Pods that export no such metric are left alone; a failed post is retried on the next
        tick."""
        desired = in_force(settings.spec, settings.effective)
        if not desired:
            return
        live = live_values(settings.spec, settings.effective)
        entries = (settings.isvc.get("status") or {}).get("remediations") or []
        try:
            since = parse_time(entries[0]["time"]) if entries else float("-inf")
        except (KeyError, TypeError, ValueError):
            since = float("-inf")
        stray: dict[str, tuple[Any, dict[str, int]]] = {}
        for target in targets:
            series = self.series.get(target.key)
            scrape = series.last if series is not None else None
            if scrape is None or not scrape.live_config or scrape.time <= since:
                continue
            wrong = {k: v for k, v in desired.items() if _drifted(scrape.live_config.get(k), v, k in live)}
            if wrong:
                stray[target.name] = (target, wrong)
        if not stray:
            return
        meta = settings.meta
        namespace, name = meta["namespace"], meta["name"]
        try:
            api_key = await read_api_key(self.kube, namespace, settings.spec)
        except ValueError as exc:
            logger.warning(f"{namespace}/{name}: cannot correct the live settings of {sorted(stray)}: {exc}")
            return
        for pod, (target, wrong) in sorted(stray.items()):
            series = self.series[target.key]
            reported = {k: series.last.live_config.get(k) for k in wrong}
            why = (await self.live.apply([target], wrong, api_key))[pod]
            what = f"{namespace}/{name}: pod {pod} reported {reported}"
            if why is None:
                logger.info(f"{what}: live settings {wrong} re-applied")
            else:
                logger.warning(f"{what}; re-applying {wrong}: {why}")

    async def _apply_live(self, settings: Settings, targets: tuple, change: Change, logger: Any) -> None:
        """Post a live change to every ready pod of the current configuration (the ConfigMap, for pods
        that start later, is already written) and check each answer; a pod that did not take it makes
        it a failed remediation: reverted, in status, the ConfigMap and the pods that took it."""
        meta = settings.meta
        namespace, name = meta["namespace"], meta["name"]
        update = {LIVE_FIELDS[change.field]: int(change.to)}
        try:
            api_key = await read_api_key(self.kube, namespace, settings.spec)
        except ValueError as exc:
            failed = {t.name: str(exc) for t in targets}
            took: list = []
        else:
            answers = await self.live.apply(targets, update, api_key)
            failed = {pod: why for pod, why in answers.items() if why is not None}
            took = [t for t in targets if answers[t.name] is None]
        if not failed:
            logger.info(f"{namespace}/{name}: {change.field} {change.to:g} live in {len(took)} pod(s)")
            return
        why = "; ".join(f"{pod}: {reason}" for pod, reason in sorted(failed.items()))
        logger.warning(f"{namespace}/{name}: live change of {change.field} failed: {why}")
        if change.lever == REVERT:
            # Nothing older to go back to: the status and the ConfigMap hold the reverted value, which
            # every pod started from now on runs.
            await self.reconciler.post_event(
                settings.isvc, "Warning", EVENT_REVERTED, f"live revert of {change.field} not taken: {why}"
            )
            return
        # Re-read: the re-render wrote the status since (still under the reconcile lock).
        path = object_path(names.API_VERSION, names.KIND, namespace, name)
        isvc = await self.kube.get(path)
        head = ((isvc or {}).get("status") or {}).get("remediations") or [{}]
        if isvc is None or isvc.get("spec") != settings.isvc.get("spec") or head[0] != change.to_status():
            logger.warning(
                f"{namespace}/{name}: changed since the live change of {change.field}: not reverting"
            )
            return
        settings = settings.with_status(isvc)
        revert = revert_update(settings, change, why, self.clock())
        body = {"metadata": {"resourceVersion": isvc["metadata"]["resourceVersion"]}}
        try:
            written = await self.kube.merge_patch(path + "/status", {**body, "status": revert.patch})
        except ApiError as exc:
            if exc.status != 409:
                raise
            # Written concurrently (e.g. a spec edit): the next tick decides on the new object.
            logger.warning(f"{namespace}/{name}: the revert of {change.field} met a concurrent write")
            return
        for type_, reason, message in revert.events:
            await self.reconciler.post_event(written, type_, reason, message)
        reverted = settings.with_status(written)
        await self._render(reverted, logger)
        if took:
            back = {LIVE_FIELDS[change.field]: int(change.from_)}
            answers = await self.live.apply(took, back, api_key)
            still = {pod: why for pod, why in answers.items() if why is not None}
            if still:
                logger.warning(f"{namespace}/{name}: pods did not take the revert of {change.field}: {still}")

    async def _render(self, settings: Settings, logger: Any) -> None:
        """Re-render the children from ``status.effective``; a failed pass is retried next tick."""
        isvc = settings.isvc
        meta = isvc["metadata"]
        key = (meta["namespace"], meta["name"])
        isvc.setdefault("apiVersion", names.API_VERSION)
        isvc.setdefault("kind", names.KIND)
        self._unrendered.add(key)
        outcome = await self.reconciler.reconcile(settings, announce=False)
        self._unrendered.discard(key)
        for line in outcome.written:
            logger.info(f"{key[0]}/{key[1]}: {line} (remediation)")


def _drifted(reported: str | None, expected: int, live: bool) -> bool:
    """Whether a pod's reported live setting (a label value) contradicts ``expected``."""
    try:
        value = int(reported) if reported is not None else None
    except ValueError:
        return False  # "None" (unbounded) or not a number: nothing to compare
    if value is None:
        return False
    return value != expected if live else value < expected
