"""The kopf side of the operator: settings, login, and a thin registry of handlers around the
:class:`~kvpilot.operator.reconcile.reconciler.Reconciler` and the remediation loop.

Triggers for one pass over an InferenceService (all serialised per object):

- kopf's create / update / resume handlers (spec or label edits, operator restarts);
- events of the engine Deployments the operator owns (rollout progress -> status; manual edits
  or deletion -> re-applied at once);
- a resync loop every ``resync_interval`` seconds over every InferenceService in scope (repairs
  drift in children that are not watched, e.g. a deleted Service);
- the remediation loop (``remediation.loop``) every ``scrape_interval`` seconds, when it changes
  ``status.effective`` in Auto mode.

The resync and the remediation loop are plain tasks rather than kopf timers on purpose: kopf puts a
finalizer on objects with timers, and a finalizer would block deleting InferenceServices whenever the
operator is not running. The operator needs none: children go away through their owner references.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

import kopf

from kvpilot.operator.api import names
from kvpilot.operator.api.rest import ApiError
from kvpilot.operator.kube import KubeClient
from kvpilot.operator.observability import MetricsServer, OperatorMetrics
from kvpilot.operator.options import OperatorOptions
from kvpilot.operator.reconcile.reconciler import Outcome, Reconciler, post_event
from kvpilot.operator.remediation.loop import Autotuner

ISVC = (names.GROUP, names.VERSION, names.PLURAL)
LOG = logging.getLogger("kvpilot.operator")
CLEANUP_S = 5.0  # how long the cleanup waits for a cancelled task, twice at most


def _login(settings: kopf.OperatorSettings, logger: logging.Logger | Any = LOG) -> Any:
    # In a pod: the mounted service-account token; elsewhere: $KUBECONFIG or ~/.kube/config.
    info = kopf.login_with_service_account(settings=settings, logger=logger) or kopf.login_with_kubeconfig(
        settings=settings, logger=logger
    )
    if info is None:
        raise kopf.LoginError("no Kubernetes credentials: neither a service account nor a kubeconfig")
    return info


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
        # An integer: the API server refuses a fractional timeoutSeconds ("300.0") on every watch.
        settings.watching.server_timeout = int(options.watch_timeout)
        settings.watching.label_selectors["apps", "deployments"] = (
            f"{names.LABEL_MANAGED_BY}={names.MANAGED_BY}"
        )
        # Only warnings and errors become Kubernetes Events; the operator posts its own Normal ones.
        settings.posting.level = logging.WARNING

        async def emit(isvc: dict, type_: str, reason: str, message: str) -> None:
            await post_event(memo.kube, isvc, type_, reason, message, LOG)

        memo.metrics = OperatorMetrics()
        memo.metrics_server = None
        if options.metrics_port is not None:
            server = MetricsServer(memo.metrics.registry, options.metrics_port, options.metrics_address)
            memo.metrics_server = server.start()
            LOG.info(f"operator metrics at http://{options.metrics_address}:{server.port}/metrics")
        memo.reconciler = Reconciler(
            memo.kube,
            emit,
            service_monitors=options.service_monitors,
            platform=options.platform,
            metrics=memo.metrics,
        )
        memo.resync = asyncio.create_task(
            memo.reconciler.resync_forever(options.scopes, options.resync_interval, LOG)
        )
        memo.autotuner = Autotuner(memo.kube, options, memo.reconciler, metrics=memo.metrics)
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
        """Stop the resync and remediation tasks (within a bound: a task that outlives two cancels is
        logged and left) and close the clients."""
        tasks = [memo.resync, memo.remediation]
        for task in tasks:
            task.cancel()
        _, pending = await asyncio.wait(tasks, timeout=CLEANUP_S)
        if pending:
            LOG.warning(f"{len(pending)} task(s) still running {CLEANUP_S:g}s after cancel: cancelling again")
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=CLEANUP_S)
            for task in pending:
                LOG.error(f"task {task.get_name()} ignored two cancels; exiting without it")
        await memo.autotuner.close()
        await memo.kube.close()
        if memo.metrics_server is not None:
            memo.metrics_server.close()

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
