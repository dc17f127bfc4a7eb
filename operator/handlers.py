"""The kopf side of the operator: settings, login, and thin handlers around ``reconcile``.

Triggers for one pass over an InferenceService (all serialised per object):

- kopf's create / update / resume handlers (spec or label edits, operator restarts);
- events of the engine Deployments the operator owns (rollout progress -> status; manual edits
  or deletion -> re-applied at once);
- a resync loop every ``resync_interval`` seconds over every InferenceService in scope (repairs
  drift in children that are not watched, e.g. a deleted Service);
- the remediation loop (``autotuner``) every ``scrape_interval`` seconds, when it changes
  ``status.effective`` in Auto mode.

The resync and the remediation loop are plain tasks rather than kopf timers on purpose: kopf puts a
finalizer on objects with timers, and a finalizer would block deleting InferenceServices whenever the
operator is not running. The operator needs none: children go away through their owner references.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import functools
import logging
import uuid
from typing import Any

import kopf

from kvpilot.operator.api import names
from kvpilot.operator.remediation.loop import Autotuner, AutotunerOptions
from kvpilot.operator.render.builders import build_event
from kvpilot.operator.kube import ApiError, KubeClient, object_path
from kvpilot.operator.reconcile.reconciler import Outcome, reconcile
from kvpilot.operator.reconcile.status import rfc3339

ISVC = (names.GROUP, names.VERSION, names.PLURAL)


@dataclasses.dataclass(frozen=True)
class OperatorOptions:
    """How ``kvpilot operator`` runs (from the command line)."""

    namespaces: tuple[str, ...] = ()
    clusterwide: bool = False
    resync_interval: float = 300.0
    watch_timeout: float = 300.0
    service_monitors: bool = False
    scrape_interval: float = 15.0
    scrape_timeout: float = 3.0
    record: str | None = None


LOG = logging.getLogger("kvpilot.operator")


def _login(settings: kopf.OperatorSettings, logger: logging.Logger | Any = LOG) -> Any:
    # In a pod: the mounted service-account token; elsewhere: $KUBECONFIG or ~/.kube/config.
    info = kopf.login_with_service_account(settings=settings, logger=logger) or kopf.login_with_kubeconfig(
        settings=settings, logger=logger
    )
    if info is None:
        raise kopf.LoginError("no Kubernetes credentials: neither a service account nor a kubeconfig")
    return info


class Reconciler:
    """Runs reconcile passes: one at a time per object, always on a fresh read of it."""

    def __init__(self, kube: KubeClient, options: OperatorOptions) -> None:
        self.kube = kube
        self.options = options
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}

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
                return Outcome(gone=True)

            async def emit(type_: str, reason: str, message: str) -> None:
                """Post an Event about this InferenceService."""
                await post_event(self.kube, isvc, type_, reason, message, logger)

            outcome = await reconcile(
                self.kube, isvc, emit, service_monitors=self.options.service_monitors, announce=announce
            )
            for line in outcome.written:
                logger.info(line)
            return outcome

    async def resync_forever(self, logger: Any) -> None:
        """Reconcile every InferenceService in scope every ``resync_interval`` seconds."""
        scopes = [None] if self.options.clusterwide else list(self.options.namespaces)
        while True:
            await asyncio.sleep(self.options.resync_interval)
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


async def post_event(
    kube: KubeClient, isvc: dict, type_: str, reason: str, message: str, logger: Any
) -> None:
    """Post a Kubernetes Event about ``isvc``; a failure is logged, never raised (events are best effort)."""
    now = datetime.datetime.now(datetime.UTC)
    body = build_event(isvc, type_, reason, message, rfc3339(now), uuid.uuid4().hex[:16])
    try:
        await kube.create(body)
    except ApiError as exc:
        logger.warning(f"cannot post event {reason}: {exc}")


def _raise_for(outcome: Outcome) -> None:
    if outcome.problems:
        raise kopf.PermanentError("invalid spec: " + "; ".join(outcome.problems))
    if outcome.conflicts:
        raise kopf.TemporaryError("; ".join(outcome.conflicts), delay=60)


def new_memo() -> kopf.Memo:
    """The shared state of the handlers: the API client exists before kopf logs in."""
    return kopf.Memo(kube=KubeClient())


def build_registry(options: OperatorOptions) -> kopf.OperatorRegistry:
    """A kopf registry with the operator's handlers (a fresh one per call: no global state)."""
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(id="configure", registry=registry)
    async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
        """kopf settings, the reconciler, and the resync task."""
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.KOPF_PREFIX)
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
            prefix=names.KOPF_PREFIX, key="last-handled-configuration"
        )
        settings.persistence.finalizer = f"{names.GROUP}/finalizer"  # never added: no delete handlers
        # Serve exactly the resources found at start-up in the given namespaces: no cluster-wide
        # permissions on namespaces or CRDs are needed (the chart installs the CRD first).
        settings.scanning.disabled = True
        settings.watching.server_timeout = options.watch_timeout
        settings.watching.label_selectors["apps", "deployments"] = (
            f"{names.LABEL_MANAGED_BY}={names.MANAGED_BY}"
        )
        # Only warnings and errors become Kubernetes Events; the operator posts its own Normal ones.
        settings.posting.level = logging.WARNING
        memo.reconciler = Reconciler(memo.kube, options)
        memo.resync = asyncio.create_task(memo.reconciler.resync_forever(LOG))

        async def emit(isvc: dict, type_: str, reason: str, message: str) -> None:
            await post_event(memo.kube, isvc, type_, reason, message, LOG)

        memo.autotuner = Autotuner(
            memo.kube,
            AutotunerOptions(
                namespaces=options.namespaces,
                clusterwide=options.clusterwide,
                scrape_interval=options.scrape_interval,
                scrape_timeout=options.scrape_timeout,
                record=options.record,
                service_monitors=options.service_monitors,
            ),
            memo.reconciler.lock,
            emit,
        )
        memo.remediation = asyncio.create_task(memo.autotuner.run_forever(LOG))

    @kopf.on.login(id="login", registry=registry)
    async def login(memo: kopf.Memo, settings: kopf.OperatorSettings, logger: Any, **_: Any) -> Any:
        """Credentials for kopf and for the reconciler's client (one identity)."""
        info = _login(settings, logger)
        memo.kube.relogin = functools.partial(_login, settings, logger)
        memo.kube.use(info)
        return info

    @kopf.on.cleanup(id="cleanup", registry=registry)
    async def cleanup(memo: kopf.Memo, **_: Any) -> None:
        """Stop the resync and remediation tasks and close the clients."""
        for task in (memo.resync, memo.remediation):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await memo.autotuner.close()
        await memo.kube.close()

    @kopf.on.resume(*ISVC, id="reconcile", registry=registry)
    @kopf.on.create(*ISVC, id="reconcile", registry=registry)
    @kopf.on.update(*ISVC, id="reconcile", registry=registry)
    async def reconcile_isvc(name: str, namespace: str, memo: kopf.Memo, logger: Any, **_: Any) -> None:
        """A pass after a spec change or a (re)start; invalid spec -> PermanentError (no retry loop)."""
        try:
            outcome = await memo.reconciler.run(namespace, name, logger, announce=True)
        except ApiError as exc:
            if exc.status == 409:
                raise kopf.TemporaryError(f"concurrent change, retrying: {exc}", delay=1) from exc
            raise kopf.TemporaryError(str(exc), delay=5 if exc.is_transient else 60) from exc
        _raise_for(outcome)

    @kopf.on.event(
        "apps",
        "v1",
        "deployments",
        labels={names.LABEL_MANAGED_BY: names.MANAGED_BY, names.LABEL_ISVC: kopf.PRESENT},
        id="engine-deployment",
        registry=registry,
    )
    async def engine_deployment_event(body: Any, memo: kopf.Memo, logger: Any, **_: Any) -> None:
        """A pass after an engine Deployment changed: rollout progress, manual edits, deletion."""
        namespace = body["metadata"]["namespace"]
        owner = body["metadata"]["labels"][names.LABEL_ISVC]
        try:
            await memo.reconciler.run(namespace, owner, logger)
        except ApiError as exc:
            # The next Deployment event or the resync catches up; never block the watch stream.
            logger.warning(f"reconcile of {namespace}/{owner} after a Deployment event failed: {exc}")

    return registry
