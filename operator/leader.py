"""Leader election over a ``coordination.k8s.io/v1`` Lease: replicas of the operator stand by and one
reconciles.

The rules are client-go's ``leaderelection``: a candidate takes the Lease when nobody holds it or when
its record (holder, renew time, resourceVersion) has not changed for ``lease_duration`` seconds *as
this candidate observed it* (its own clock, never the holder's timestamps, so clock skew cannot hand
the Lease over early); every write carries the ``resourceVersion`` it read, so of two candidates
racing for an expired Lease the API server lets exactly one win (409 for the other). The leader renews
every ``retry_period``; when it has not renewed for ``renew_deadline`` (< ``lease_duration``) it stops
reconciling and exits before any standby can consider the Lease expired: two operators never write at
the same time. On a clean shutdown the leader releases the Lease, so a standby takes over at once.

``run_elected`` wraps kopf: a standby answers the liveness endpoint itself (it is alive, just not
leading) and starts kopf once it holds the Lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import logging
import math
import os
import signal
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from kvpilot.operator.aio import wait_event
from kvpilot.operator.api.rest import ApiError

LOG = logging.getLogger("kvpilot.operator.leader")
LEASE_API = "coordination.k8s.io/v1"
SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


class LeaderElectionError(ValueError):
    """The leader-election settings are inconsistent; the message says which and why."""


@dataclasses.dataclass(frozen=True)
class LeaseConfig:
    """Which Lease to hold and how.

    ``lease_duration``: seconds a standby waits, after the Lease last changed, before taking it;
    ``renew_deadline``: seconds the leader keeps leading without a successful renewal;
    ``retry_period``: seconds between two attempts (renewals, or a standby's checks).
    Raises LeaderElectionError unless 0 < retry_period < renew_deadline < lease_duration.
    """

    name: str
    namespace: str
    identity: str
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not self.name or not self.namespace or not self.identity:
            raise LeaderElectionError("leader election needs a Lease name, a namespace and an identity")
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise LeaderElectionError(
                "leader election needs 0 < retry period < renew deadline < lease duration, got "
                f"{self.retry_period} / {self.renew_deadline} / {self.lease_duration} s: a leader must "
                "stop before a standby may take over"
            )

    @property
    def path(self) -> str:
        return f"/apis/{LEASE_API}/namespaces/{self.namespace}/leases/{self.name}"


def default_identity() -> str:
    """The pod's name (its hostname) plus a random suffix: unique across restarts of one pod."""
    return f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def default_namespace() -> str | None:
    """The namespace the pod runs in ($POD_NAMESPACE, else the service account's), or None."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        with open(SA_NAMESPACE_FILE, encoding="utf-8") as f:
            return f.read().strip() or None
    except OSError:
        return None


def micro_time(now: datetime.datetime | None = None) -> str:
    """A Kubernetes MicroTime (``2026-01-02T03:04:05.000006Z``)."""
    now = now or datetime.datetime.now(datetime.UTC)
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """Acquires, renews and releases one Lease through ``kube`` (``get``, ``request``, ``merge_patch``
    of ``kvpilot.operator.kube.KubeClient``). ``clock``: monotonic seconds (tests pass their own)."""

    def __init__(self, kube: Any, config: LeaseConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.kube = kube
        self.config = config
        self.clock = clock
        self._observed: tuple[Any, ...] | None = None
        self._observed_at = 0.0
        self._resource_version: str | None = None
        self.is_leader = False
        self.last_renewal: float | None = None

    def _observe(self, lease: dict[str, Any]) -> None:
        spec = lease.get("spec") or {}
        record = (spec.get("holderIdentity"), spec.get("renewTime"), lease["metadata"].get("resourceVersion"))
        if record != self._observed:
            self._observed, self._observed_at = record, self.clock()
        self._resource_version = lease["metadata"].get("resourceVersion")

    def _held(self, stamp: str, transitions: int) -> dict[str, Any]:
        return {
            "holderIdentity": self.config.identity,
            "leaseDurationSeconds": math.ceil(self.config.lease_duration),
            "acquireTime": stamp,
            "renewTime": stamp,
            "leaseTransitions": transitions,
        }

    async def try_acquire_or_renew(self) -> bool:
        """One attempt; True when this candidate holds the Lease afterwards. Raises ApiError for
        anything but a lost race (409)."""
        cfg = self.config
        stamp = micro_time()
        lease = await self.kube.get(cfg.path)
        if lease is None:
            body = {
                "apiVersion": LEASE_API,
                "kind": "Lease",
                "metadata": {"name": cfg.name, "namespace": cfg.namespace},
                "spec": self._held(stamp, 0),
            }
            try:
                created = await self.kube.request("POST", cfg.path.rsplit("/", 1)[0], body=body)
            except ApiError as exc:
                if exc.status == 409:  # another candidate created it first
                    return self._lost()
                raise
            return self._won(created)
        self._observe(lease)
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        duration = float(spec.get("leaseDurationSeconds") or cfg.lease_duration)
        if holder and holder != cfg.identity and self.clock() - self._observed_at <= duration:
            return self._lost()
        if holder == cfg.identity:
            change: dict[str, Any] = {
                "renewTime": stamp,
                "leaseDurationSeconds": math.ceil(cfg.lease_duration),
            }
        else:
            change = self._held(stamp, int(spec.get("leaseTransitions") or 0) + 1)
        patch = {"metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]}, "spec": change}
        try:
            updated = await self.kube.merge_patch(cfg.path, patch)
        except ApiError as exc:
            if exc.status == 409:  # changed since we read it: someone else renewed or took it
                return self._lost()
            raise
        if holder != cfg.identity:
            LOG.info("took over Lease %s/%s from %r", cfg.namespace, cfg.name, holder or None)
        return self._won(updated)

    def _won(self, lease: dict[str, Any]) -> bool:
        self._observe(lease)
        self.is_leader, self.last_renewal = True, self.clock()
        return True

    def _lost(self) -> bool:
        self.is_leader = False
        return False

    async def _attempt(self) -> bool:
        try:
            return await self.try_acquire_or_renew()
        except ApiError as exc:  # the API unreachable or erroring: try again next period
            LOG.warning("Lease %s/%s: %s", self.config.namespace, self.config.name, exc)
            return False

    async def acquire(self, stop: asyncio.Event) -> bool:
        """Wait until this candidate holds the Lease (True) or ``stop`` is set (False)."""
        while not stop.is_set():
            if await self._attempt():
                return True
            await wait_event(stop, self.config.retry_period)
        return False

    async def hold(self) -> None:
        """Renew every retry period; return once no renewal succeeded for ``renew_deadline``
        seconds, or the Lease went to another holder (leadership is lost either way)."""
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.retry_period)
            renewed = await self._attempt()
            if not renewed and (self._observed or (None,))[0] not in (None, "", cfg.identity):
                LOG.error(
                    "Lease %s/%s is held by %r now: stepping down", cfg.namespace, cfg.name, self._observed[0]
                )
                return
            if not renewed and self.clock() - (self.last_renewal or 0.0) >= cfg.renew_deadline:
                LOG.error(
                    "Lease %s/%s not renewed for %.1f s: stepping down",
                    cfg.namespace,
                    cfg.name,
                    cfg.renew_deadline,
                )
                self.is_leader = False
                return

    async def release(self) -> None:
        """Give the Lease up (a clean shutdown) so a standby takes it at its next attempt. Reads it
        first: a renewal cut short by the shutdown may have changed it after our last look."""
        if not self.is_leader:
            return
        cfg = self.config
        for _ in range(3):
            try:
                lease = await self.kube.get(cfg.path)
                if lease is None or (lease.get("spec") or {}).get("holderIdentity") != cfg.identity:
                    break  # not ours any more: nothing to release
                patch = {
                    "metadata": {"resourceVersion": lease["metadata"]["resourceVersion"]},
                    "spec": {"holderIdentity": "", "leaseDurationSeconds": 1, "renewTime": micro_time()},
                }
                await self.kube.merge_patch(cfg.path, patch)
                break
            except ApiError as exc:
                LOG.warning("could not release Lease %s/%s: %s", cfg.namespace, cfg.name, exc)
                if exc.status != 409:
                    break
        self.is_leader = False


async def _serve_health(liveness_endpoint: str) -> Any:
    """Answer the liveness URL's path with 200 while standing by (the process is alive)."""
    from aiohttp import web

    url = urlsplit(liveness_endpoint)
    app = web.Application()
    app.router.add_get(url.path or "/", lambda request: web.json_response({"leader": False}))
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, url.hostname or "0.0.0.0", url.port or 80).start()
    return runner


async def run_elected_async(config: LeaseConfig, kube: Any, operator_kwargs: dict[str, Any]) -> int:
    """Stand by until ``config``'s Lease is ours, then run ``kopf.operator(**operator_kwargs)`` while
    renewing it. Returns 0 after a clean stop (SIGTERM/SIGINT; the Lease released), 1 when
    leadership was lost (the process must end: the pod restarts as a standby)."""
    import kopf

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    elector = LeaderElector(kube, config)
    liveness = operator_kwargs.get("liveness_endpoint")
    health = await _serve_health(liveness) if liveness else None
    LOG.info("standing by for Lease %s/%s as %s", config.namespace, config.name, config.identity)
    try:
        acquired = await elector.acquire(stop)
    finally:
        if health is not None:
            await health.cleanup()  # frees the port for kopf's own liveness endpoint
    if not acquired:
        return 0
    LOG.info("leading: Lease %s/%s is held by %s", config.namespace, config.name, config.identity)
    kopf_stop = asyncio.Event()
    operator_task = asyncio.create_task(kopf.operator(**operator_kwargs, stop_flag=kopf_stop))
    hold_task = asyncio.create_task(elector.hold())
    stop_task = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({operator_task, hold_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    lost = hold_task in done
    kopf_stop.set()
    stop_task.cancel()
    # A leader that lost the Lease must stop before a standby may take it over (lease_duration after
    # the last renewal at the earliest, renew_deadline of which have passed). One stopping cleanly
    # keeps renewing until kopf has stopped, so no standby starts while it still writes.
    grace = config.lease_duration - config.renew_deadline if lost else config.lease_duration
    await asyncio.wait(
        {operator_task} if lost else {operator_task, hold_task},
        timeout=grace,
        return_when=asyncio.FIRST_COMPLETED,
    )
    lost = lost or (hold_task.done() and not operator_task.done())
    if not operator_task.done():
        operator_task.cancel()
        await asyncio.wait({operator_task})
    hold_task.cancel()
    await asyncio.wait({hold_task})
    if lost:
        return 1
    await elector.release()
    if operator_task.done() and not operator_task.cancelled() and operator_task.exception() is not None:
        raise operator_task.exception()
    return 0


def add_arguments(parser: Any) -> None:
    """The ``kvpilot operator`` flags of leader election."""
    group = parser.add_argument_group("leader election (replicas > 1)")
    group.add_argument(
        "--leader-elect",
        action="store_true",
        help="stand by until this replica holds a coordination.k8s.io Lease, then reconcile while "
        "renewing it (needs get/create/patch on leases in the Lease's namespace)",
    )
    group.add_argument(
        "--leader-elect-lease", default="kvpilot-operator", metavar="NAME", help="the Lease's name"
    )
    group.add_argument(
        "--leader-elect-namespace",
        default=None,
        metavar="NS",
        help="the Lease's namespace (default: $POD_NAMESPACE, else the pod's service-account namespace)",
    )
    group.add_argument(
        "--leader-elect-identity", default=None, metavar="ID", help="default: hostname + random"
    )
    for flag, default, what in (
        ("lease-duration", 15.0, "a standby takes over this long after the Lease last changed"),
        ("renew-deadline", 10.0, "the leader steps down after this long without a renewal"),
        ("retry-period", 2.0, "between two renewals or standby checks"),
    ):
        group.add_argument(
            f"--leader-elect-{flag}",
            type=float,
            default=default,
            metavar="SECONDS",
            help=f"{what} (default: {default:g})",
        )


def config_from(args: Any) -> LeaseConfig:
    """The LeaseConfig of parsed ``kvpilot operator`` args; raises LeaderElectionError."""
    namespace = args.leader_elect_namespace or default_namespace()
    if not namespace:
        raise LeaderElectionError(
            "--leader-elect needs --leader-elect-namespace (or $POD_NAMESPACE) outside a pod"
        )
    return LeaseConfig(
        name=args.leader_elect_lease,
        namespace=namespace,
        identity=args.leader_elect_identity or default_identity(),
        lease_duration=args.leader_elect_lease_duration,
        renew_deadline=args.leader_elect_renew_deadline,
        retry_period=args.leader_elect_retry_period,
    )


def run_elected(config: LeaseConfig, operator_kwargs: dict[str, Any]) -> int:
    """Log in as kopf does (service account, else kubeconfig) and run ``run_elected_async``."""
    import kopf

    from kvpilot.operator.kube import KubeClient

    settings = kopf.OperatorSettings()

    def login() -> Any:
        info = kopf.login_with_service_account(settings=settings, logger=LOG) or kopf.login_with_kubeconfig(
            settings=settings, logger=LOG
        )
        if info is None:
            raise LeaderElectionError("no Kubernetes credentials: neither a service account nor a kubeconfig")
        return info

    async def main() -> int:
        kube = KubeClient(relogin=login)
        kube.use(login())
        try:
            return await run_elected_async(config, kube, operator_kwargs)
        finally:
            await kube.close()

    return asyncio.run(main())
