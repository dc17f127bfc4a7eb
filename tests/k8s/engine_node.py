"""The kubelet of the kwok node ``kwok-engines``: each of its pods runs as a real ``kvpilot serve``.

kwok (kwok.yaml) moves a pod scheduled there to Running with an IP from the node's loopback range
(127.0.2.0/24) and leaves it not Ready. This kubelet does the rest, as a node's would:

- it starts the pod's engine container (the rendered args, the model directory made local, the
  live-config ConfigMap written to a file as a volume would hold it) bound to the pod's IP and its
  ``http`` port, so the operator scrapes and configures it at ``<pod IP>:8000`` like any pod;
- it marks the pod Ready once ``/health`` answers, and not Ready while the process is down;
- when kwok reports the container restarted (the OOM-kill stage raises ``restartCount``), it kills
  the process and starts it again, as a container runtime restarts an OOM-killed container;
- it stops the process of a pod that is terminating or gone (SIGTERM, then SIGKILL).

Only process groups it started are ever signalled (``Replica.signal``).
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from kvpilot.operator.api import names
from kvpilot.operator.api.timefmt import format_time
from kvpilot.operator.local.process import Replica, local_args, local_env
from kvpilot.operator.remediation.pods import is_ready
from tests.k8s.cluster import ENGINES_NODE, Cluster

GRACE_S = 10.0


class EngineNode:
    """Runs the engines of ``ENGINES_NODE``'s pods (see the module docstring) on ``model_dir``."""

    def __init__(self, cluster: Cluster, model_dir: Path, log_dir: Path) -> None:
        self.cluster, self.model_dir, self.log_dir = cluster, model_dir, log_dir
        self.replicas: dict[str, Replica] = {}  # pod uid -> its engine
        self.ips: dict[str, str] = {}  # pod uid -> pod IP
        self.restarts: dict[str, int] = {}  # pod uid -> restartCount already acted on
        self.started: list[tuple[str, str]] = []  # (pod name, pod IP), in order
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-node", daemon=True)

    def start(self) -> EngineNode:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        for uid in list(self.replicas):
            self._end(uid, "the node stops")

    # -- the sync loop ----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except (OSError, urllib.error.URLError, ValueError, KeyError) as exc:
                self.errors.append(repr(exc))
            self._stop.wait(0.5)

    def pods(self) -> list[dict[str, Any]]:
        listing = self.cluster.request("GET", f"/api/v1/pods?fieldSelector=spec.nodeName%3D{ENGINES_NODE}")
        return listing.get("items") or []

    def sync(self) -> None:
        seen = set()
        for pod in self.pods():
            meta, status = pod["metadata"], pod.get("status") or {}
            uid = meta["uid"]
            if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP"):
                continue
            seen.add(uid)
            replica = self.replicas.get(uid)
            if replica is None:
                replica = self._create(pod)
            restarts = _engine_status(pod).get("restartCount", 0)
            if restarts > self.restarts.setdefault(uid, restarts):
                # The container was killed (kwok's OOM stage): the runtime restarts it.
                self.restarts[uid] = restarts
                replica.reap()
                self._set_ready(pod, False)
                replica.start()
                continue
            if replica.has_exited():
                code = replica.reap()
                self.errors.append(f"{meta['name']}: engine exited ({code})")
                replica.start()
            healthy = self._healthy(uid)
            if healthy != is_ready(pod):
                self._set_ready(pod, healthy)
        for uid in [u for u in self.replicas if u not in seen]:
            self._end(uid, "the pod is terminating or gone")

    # -- one pod ----------------------------------------------------------------------------------

    def _create(self, pod: dict[str, Any]) -> Replica:
        meta, ip = pod["metadata"], pod["status"]["podIP"]
        (container,) = [c for c in pod["spec"]["containers"] if c["name"] == names.ENGINE_CONTAINER]
        port = next(
            (
                p["containerPort"]
                for p in container.get("ports") or []
                if p.get("name") == names.HTTP_PORT_NAME
            ),
            names.HTTP_PORT,
        )
        args, _ = local_args(container, port, model_dir=str(self.model_dir))
        args[args.index("--host") + 1] = ip  # bound to the pod's own address, as in a pod's netns
        if names.LIVE_CONFIG_FLAG in args:
            args[args.index(names.LIVE_CONFIG_FLAG) + 1] = str(self._live_config(pod))
        env, _ = local_env(container)
        env.setdefault("OMP_NUM_THREADS", "1")
        labels = meta.get("labels") or {}
        replica = Replica(
            name=meta["name"],
            uid=meta["uid"],
            template_hash=labels.get(names.LABEL_TEMPLATE_HASH, ""),
            labels=labels,
            args=args,
            env=env,
            port=port,
            log_path=self.log_dir / f"{meta['name']}.log",
            created=time.monotonic(),
        )
        replica.start()
        self.replicas[meta["uid"]] = replica
        self.ips[meta["uid"]] = ip
        self.started.append((meta["name"], ip))
        return replica

    def _live_config(self, pod: dict[str, Any]) -> Path:
        """The live-config ConfigMap's file as the pod's volume holds it at start (none: no file)."""
        meta = pod["metadata"]
        path = self.log_dir / f"{meta['name']}-live-config.json"
        owner = (meta.get("labels") or {}).get(names.LABEL_ISVC, "")
        config_map = self.cluster.request(
            "GET", f"/api/v1/namespaces/{meta['namespace']}/configmaps/{names.live_config_name(owner)}"
        )
        text = (config_map.get("data") or {}).get(names.LIVE_CONFIG_KEY)
        if text is not None:
            path.write_text(text)
        return path

    def _healthy(self, uid: str) -> bool:
        replica = self.replicas[uid]
        url = f"http://{self.ips[uid]}:{replica.port}{names.HEALTH_PATH}"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 - loopback
                return response.status == 200
        except OSError:
            return False

    def _set_ready(self, pod: dict[str, Any], ready: bool) -> None:
        meta = pod["metadata"]
        now, value = format_time(time.time()), "True" if ready else "False"
        engine = {**_engine_status(pod), "name": names.ENGINE_CONTAINER, "ready": ready}
        patch = {
            "status": {
                "conditions": [
                    {"type": kind, "status": value, "lastTransitionTime": now}
                    for kind in ("Ready", "ContainersReady")
                ],
                "containerStatuses": [engine],
            }
        }
        self.cluster.request(
            "PATCH",
            f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status",
            json.dumps(patch),
            **{"Content-Type": "application/strategic-merge-patch+json"},
        )

    def _end(self, uid: str, why: str) -> None:
        replica = self.replicas.pop(uid)
        self.ips.pop(uid, None)
        if replica.proc is None:
            return
        replica.signal(signal.SIGTERM)
        deadline = time.monotonic() + GRACE_S
        while not replica.has_exited() and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            replica.reap()

    def pids(self) -> list[int]:
        return [r.pid for r in self.replicas.values() if r.pid is not None]


def _engine_status(pod: dict[str, Any]) -> dict[str, Any]:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return next((dict(s) for s in statuses if s.get("name") == names.ENGINE_CONTAINER), {})
