"""The local kubelet: the engine Deployment's pods as ``kvpilot serve`` processes on loopback ports.

It does for one machine what a cluster's Deployment controller, ReplicaSet controller and kubelet do
for the engine Deployment the operator renders (``render.builders.build_deployment``), reading it from the
:class:`~kvpilot.operator.local.api.LocalApi` and writing back what they would::

    Deployment (rendered by reconcile)          processes                    back into the store
    spec.replicas, template-hash label  ──►  start / stop, rolling      ──►  Pods (labels, port, Ready,
    container args, env, resources           per maxSurge/maxUnavailable     containerStatuses), and the
                                             crash → back-off → restart      Deployment's status

- A replica runs the container's args with ``--host 127.0.0.1 --port <a free port>``; settings a CPU
  machine cannot honour (``--device cuda``, the Triton backend, GPU limits) are changed or ignored with
  one log line each; ``resources.requests.cpu`` sets ``OMP_NUM_THREADS``. On a GPU machine each replica
  gets GPUs of its own (``CUDA_VISIBLE_DEVICES``, as many as its pod's limit) while there are enough.
- The live-config ConfigMap (runtime kvpilot) is mounted as a cluster's kubelet mounts it: written to a
  file before every start, its path passed as ``--live-config-file``; a replica started after a live
  change runs the values in force.
- Readiness is the container's readiness probe (``GET /health``); only ready pods are endpoints.
- A process that exits on its own is restarted with the same args after a back-off (1 s doubling to
  30 s); meanwhile its Pod shows ``CrashLoopBackOff``, which ``remediation.pods.classify`` reads as
  failing, so the remediation policy reverts a change whose pods crash, as in a cluster.
- Stopping sends SIGTERM to the replica's process group and SIGKILL after the grace period (see
  ``local.process``: only groups this kubelet started are ever signalled).
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from kvpilot.operator.aio import wait_event
from kvpilot.operator.api import names
from kvpilot.operator.api.rest import object_path
from kvpilot.operator.api.timefmt import format_time
from kvpilot.operator.local.process import (
    LOCAL_HOST,
    Replica,
    assign_gpus,
    exit_description,
    free_port,
    gpu_ids,
    gpus_requested,
    local_args,
    local_env,
    log_tail,
    replica_command,
    resolve_int_or_percent,
)

PROBE_TIMEOUT_S = 2.0
READINESS_FAILURES = 3  # consecutive failed probes before a ready replica counts as unready
BACKOFF_START_S, BACKOFF_MAX_S = 1.0, 30.0
GRACE_MAX_S = 10.0  # a local stop waits at most this long before SIGKILL (pods get 120 s by default)
SYNC_INTERVAL_S = 0.5


class LocalKubelet:
    """Keeps processes in line with the engine Deployment at ``deployment_path`` in ``api``.

    ``model_dir``: run every replica on this directory instead of the model source's path.
    ``on_change``: called after a sync that changed a Pod or the Deployment's status.
    """

    def __init__(
        self,
        api: Any,
        namespace: str,
        name: str,
        log_dir: Path,
        *,
        model_dir: str | None = None,
        gpu: bool | None = None,
        vllm_python: str | None = None,
        logger: Any,
        on_change: Callable[[], Any] | None = None,
        grace_max_s: float = GRACE_MAX_S,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.deployment_path = object_path("apps/v1", "Deployment", namespace, name)
        self.live_config_path = object_path("v1", "ConfigMap", namespace, names.live_config_name(name))
        self.live_config_file = Path(log_dir) / f"{name}-live-config.json"
        self.log_dir = Path(log_dir)
        self.model_dir = model_dir
        self.vllm_python = vllm_python
        self.gpu_ids = gpu_ids() if gpu is None else (["0"] if gpu else [])
        self.gpu = bool(self.gpu_ids)
        self.logger = logger
        self.on_change = on_change
        self.grace_max_s = grace_max_s
        self.replicas: list[Replica] = []
        self._notes: set[str] = set()
        self._session: aiohttp.ClientSession | None = None
        self._rollout_since: tuple[str, float] | None = None

    # --- the loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Sync every ``SYNC_INTERVAL_S`` seconds, or at once when the store changes."""
        while True:
            self.api.changed.clear()
            await self.sync()
            await wait_event(self.api.changed, SYNC_INTERVAL_S)

    async def sync(self) -> None:
        """One pass: reap exits, restart after back-off, probe, roll out, publish Pods and status."""
        now = time.monotonic()
        self._reap(now)
        for replica in self.replicas:
            if replica.proc is None and replica.restart_at is not None and now >= replica.restart_at:
                if replica.stopping_since is None:
                    self._spawn(replica)
        await self._probe()
        deployment = self.api.read(self.deployment_path)  # read after the await: the newest rendering
        self._roll_out(deployment, time.monotonic())
        if self._publish(deployment, time.monotonic()) and self.on_change is not None:
            result = self.on_change()
            if asyncio.iscoroutine(result):
                await result

    async def close(self) -> None:
        """Stop every replica (SIGTERM, then SIGKILL after the grace period) and wait for them."""
        now = time.monotonic()
        for replica in list(self.replicas):
            if replica.stopping_since is None:
                self._stop(replica, now, "shutting down")
        deadline = now + self.grace_max_s
        while any(r.proc is not None for r in self.replicas) and time.monotonic() < deadline:
            self._reap(time.monotonic())
            await asyncio.sleep(0.1)
        for replica in self.replicas:
            if replica.proc is not None:
                replica.reap()  # SIGKILL: the grace period is over
        self.replicas.clear()
        if self._session is not None:
            await self._session.close()
            self._session = None

    # --- processes --------------------------------------------------------------------------

    def _note(self, note: str) -> None:
        if note not in self._notes:
            self._notes.add(note)
            self.logger.info(note)

    def _create(self, deployment: dict[str, Any], now: float) -> Replica:
        template = deployment["spec"]["template"]
        labels = dict(template["metadata"]["labels"])
        template_hash = labels[names.LABEL_TEMPLATE_HASH]
        (container,) = [c for c in template["spec"]["containers"] if c["name"] == names.ENGINE_CONTAINER]
        port = free_port()
        args, notes = local_args(container, port, model_dir=self.model_dir, gpu=self.gpu)
        if names.LIVE_CONFIG_FLAG in args:
            args[args.index(names.LIVE_CONFIG_FLAG) + 1] = str(self.live_config_file)
        command = replica_command(container, self.vllm_python)
        env, env_notes = local_env(container)
        for note in notes + env_notes:
            self._note(note)
        wanted = gpus_requested(container)
        gpus, own = assign_gpus(self.gpu_ids, [r.gpus for r in self.replicas], wanted)
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
            if not own:
                self._note(
                    f"not enough free GPUs ({len(self.gpu_ids)} here, {wanted} per replica): replicas "
                    "share GPUs, lower gpuMemoryUtilization accordingly"
                )
        suffix = uuid.uuid4().hex[:5]
        name = f"{deployment['metadata']['name']}-{template_hash[:8]}-{suffix}"
        replica = Replica(
            name=name,
            uid=str(uuid.uuid4()),
            template_hash=template_hash,
            labels=labels,
            args=args,
            env=env,
            port=port,
            log_path=self.log_dir / f"{name}.log",
            created=now,
            gpus=gpus,
            command=command,
        )
        self.replicas.append(replica)
        self._spawn(replica)
        return replica

    def write_live_config(self) -> None:
        """The live-config ConfigMap's file as a kubelet's volume holds it (no ConfigMap: no file, so
        the replica runs its start-up values)."""
        config_map = self.api.read(self.live_config_path)
        text = ((config_map or {}).get("data") or {}).get(names.LIVE_CONFIG_KEY)
        if text is None:
            self.live_config_file.unlink(missing_ok=True)
            return
        self.live_config_file.parent.mkdir(parents=True, exist_ok=True)
        partial = self.live_config_file.with_suffix(".tmp")
        partial.write_text(text)
        partial.replace(self.live_config_file)  # a replica never reads half a file

    def _spawn(self, replica: Replica) -> None:
        if names.LIVE_CONFIG_FLAG in replica.args:
            self.write_live_config()
        replica.start()
        again = f" (restart {replica.restarts})" if replica.restarts else ""
        self.logger.info(
            f"replica {replica.name}: started{again}, pid {replica.pid}, port {replica.port}, "
            f"log {replica.log_path}"
        )
        command = " ".join(replica.command) if replica.command else "kvpilot serve"
        self.logger.debug(f"replica {replica.name}: {command} {' '.join(replica.args)}")

    def _stop(self, replica: Replica, now: float, why: str) -> None:
        replica.stopping_since = now
        replica.ready = False
        replica.restart_at = None
        if replica.proc is None:
            self.replicas.remove(replica)
        else:
            replica.signal(signal.SIGTERM)
        self.logger.info(f"replica {replica.name}: stopping ({why})")

    def _reap(self, now: float) -> None:
        for replica in list(self.replicas):
            if replica.proc is None:
                continue
            if not replica.has_exited():
                grace = now - (replica.stopping_since or now)
                if replica.stopping_since is not None and grace > self.grace_max_s:
                    replica.signal(signal.SIGKILL)
                continue
            code = replica.reap()
            if replica.stopping_since is not None:
                self.replicas.remove(replica)
                self.logger.info(f"replica {replica.name}: stopped ({exit_description(code)})")
                continue
            replica.restarts += 1
            replica.last_exit = code
            backoff = min(BACKOFF_MAX_S, BACKOFF_START_S * 2 ** (replica.restarts - 1))
            replica.restart_at = now + backoff
            tail = log_tail(replica.log_path)
            self.logger.warning(
                f"replica {replica.name}: {exit_description(code)}; restarting in {backoff:g}s "
                f"(restart {replica.restarts}); the end of {replica.log_path}:\n{tail}"
            )

    async def _probe(self) -> None:
        running = [r for r in self.replicas if r.proc is not None and r.stopping_since is None]
        if not running:
            return
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S))
        results = await asyncio.gather(*(self._probe_one(r) for r in running))
        for replica, ok in zip(running, results, strict=True):
            if ok:
                if not replica.ready:
                    took = time.monotonic() - replica.started_at
                    self.logger.info(f"replica {replica.name}: ready at {replica.url} ({took:.1f}s)")
                replica.ready, replica.probe_failures = True, 0
            elif replica.ready:
                replica.probe_failures += 1
                if replica.probe_failures >= READINESS_FAILURES:
                    replica.ready = False
                    self.logger.warning(f"replica {replica.name}: not ready (health checks fail)")

    async def _probe_one(self, replica: Replica) -> bool:
        try:
            async with self._session.get(replica.url + names.HEALTH_PATH) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    # --- the Deployment and ReplicaSet controllers ----------------------------------------------

    def _roll_out(self, deployment: dict[str, Any] | None, now: float) -> None:
        active = [r for r in self.replicas if r.stopping_since is None]
        if deployment is None:
            for replica in active:
                self._stop(replica, now, "the Deployment is gone")
            return
        spec = deployment["spec"]
        desired = int(spec.get("replicas", 1))
        template_hash = spec["template"]["metadata"]["labels"][names.LABEL_TEMPLATE_HASH]
        rolling = (spec.get("strategy") or {}).get("rollingUpdate") or {}
        surge = resolve_int_or_percent(rolling.get("maxSurge", "25%"), desired, round_up=True)
        unavailable = resolve_int_or_percent(rolling.get("maxUnavailable", "25%"), desired, round_up=False)
        if surge == 0 and unavailable == 0:
            unavailable = 1
        new = [r for r in active if r.template_hash == template_hash]
        old = [r for r in active if r.template_hash != template_hash]
        ready = sum(r.ready for r in active)
        # Old replicas: unready ones at once (they serve nothing), ready ones while enough stay available.
        for replica in sorted(old, key=lambda r: (r.ready, r.created)):
            if not replica.ready:
                self._stop(replica, now, "outdated configuration")
                active.remove(replica)
            elif ready - 1 >= desired - unavailable:
                self._stop(replica, now, "outdated configuration")
                active.remove(replica)
                ready -= 1
        # Too many current replicas (scale-down): unready first, then the newest.
        for replica in sorted(new, key=lambda r: (r.ready, -r.created))[: max(0, len(new) - desired)]:
            self._stop(replica, now, f"scaled down to {desired}")
            active.remove(replica)
            new.remove(replica)
        while len(active) < desired + surge and len(new) < desired:
            replica = self._create(deployment, now)
            active.append(replica)
            new.append(replica)

    def _publish(self, deployment: dict[str, Any] | None, now: float) -> bool:
        """Write the Pods and the Deployment's status; whether anything changed."""
        changed = False
        pods_path = object_path("v1", "Pod", self.namespace)
        live = {r.name for r in self.replicas}
        for pod in self.api.list("pods", self.namespace):
            name = pod["metadata"]["name"]
            if name not in live and pod["metadata"].get("labels", {}).get(names.LABEL_TEMPLATE_HASH):
                changed |= self.api.remove(f"{pods_path}/{name}")
        for replica in self.replicas:
            before = self.api.read(f"{pods_path}/{replica.name}")
            after = self.api.put(f"{pods_path}/{replica.name}", self._pod(replica, deployment))
            changed |= (
                before is None
                or before["metadata"]["resourceVersion"] != after["metadata"]["resourceVersion"]
            )
        if deployment is not None:
            changed |= self.api.write_status(self.deployment_path, self._deployment_status(deployment, now))
        return changed

    def _pod(self, replica: Replica, deployment: dict[str, Any] | None) -> dict[str, Any]:
        template = (deployment or {}).get("spec", {}).get("template", {})
        container: dict[str, Any] = {"name": names.ENGINE_CONTAINER, "ready": replica.ready}
        container["restartCount"] = replica.restarts
        if replica.proc is not None:
            container["state"] = {"running": {}}
        elif replica.restart_at is not None:
            message = f"back-off restarting the engine (exit code {replica.last_exit})"
            container["state"] = {"waiting": {"reason": "CrashLoopBackOff", "message": message}}
        else:
            container["state"] = {"waiting": {"reason": "ContainerCreating"}}
        if replica.last_exit is not None:
            reason = "Completed" if replica.last_exit == 0 else "Error"
            container["lastState"] = {"terminated": {"exitCode": replica.last_exit, "reason": reason}}
        metadata: dict[str, Any] = {
            "name": replica.name,
            "namespace": self.namespace,
            "uid": replica.uid,
            "labels": replica.labels,
            "annotations": dict((template.get("metadata") or {}).get("annotations") or {}),
        }
        if replica.stopping_since is not None:
            since = time.time() - (time.monotonic() - replica.stopping_since)
            metadata["deletionTimestamp"] = format_time(since)
        port = {"name": names.HTTP_PORT_NAME, "containerPort": replica.port, "protocol": "TCP"}
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": metadata,
            "spec": {"containers": [{"name": names.ENGINE_CONTAINER, "args": replica.args, "ports": [port]}]},
            "status": {
                "phase": "Running" if replica.proc is not None else "Pending",
                "podIP": LOCAL_HOST,
                "conditions": [{"type": "Ready", "status": "True" if replica.ready else "False"}],
                "containerStatuses": [container],
            },
        }

    def _deployment_status(self, deployment: dict[str, Any], now: float) -> dict[str, Any]:
        spec = deployment["spec"]
        desired = int(spec.get("replicas", 1))
        template_hash = spec["template"]["metadata"]["labels"][names.LABEL_TEMPLATE_HASH]
        active = [r for r in self.replicas if r.stopping_since is None]
        updated = [r for r in active if r.template_hash == template_hash]
        ready = sum(r.ready for r in active)
        complete = len(updated) == desired == len(active) and all(r.ready for r in updated)
        target = f"{template_hash}/{desired}"
        if complete:
            self._rollout_since = None
            progressing = {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"}
        else:
            if self._rollout_since is None or self._rollout_since[0] != target:
                self._rollout_since = (target, now)
            deadline = float(spec.get("progressDeadlineSeconds") or 600)
            if now - self._rollout_since[1] > deadline:
                progressing = {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}
            else:
                progressing = {"type": "Progressing", "status": "True", "reason": "ReplicaSetUpdated"}
        return {
            "observedGeneration": deployment["metadata"].get("generation"),
            "replicas": len(active),
            "updatedReplicas": len(updated),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "conditions": [progressing],
        }

    def snapshot(self) -> list[dict[str, Any]]:
        """The replicas as ``/local/status`` shows them."""
        deployment = self.api.read(self.deployment_path)
        current = (
            deployment["spec"]["template"]["metadata"]["labels"][names.LABEL_TEMPLATE_HASH]
            if deployment
            else None
        )
        return [
            {
                "name": r.name,
                "state": r.state,
                "ready": r.ready,
                "current": r.template_hash == current,
                "url": r.url,
                "pid": r.pid,
                "gpus": r.gpus,
                "restarts": r.restarts,
                "lastExitCode": r.last_exit,
                "args": r.args,
                "log": str(r.log_path),
            }
            for r in self.replicas
        ]
