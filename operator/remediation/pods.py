"""Engine pods as the remediation loop sees them: which to scrape, which fail, which are outdated.

Pure functions over Pod objects as the API server returns them. Only pods of the *current*
configuration (their ``serving.kvpilot.io/template-hash`` label equals the Deployment template the
operator renders now, and their engine container runs the rendered image and env: a hand edit of the
Deployment keeps the label) count: metrics of a pod running another configuration say nothing
about this one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from kvpilot.operator.api import names
from kvpilot.operator.api.timefmt import parse_time

# Container states that mean the configuration does not run (and will not by waiting).
FAILING_WAITING_REASONS = frozenset(
    {"CrashLoopBackOff", "ErrImagePull", "ImagePullBackOff", "CreateContainerConfigError", "InvalidImageName"}
)
FAILING_TERMINATED_REASONS = frozenset({"OOMKilled", "Error", "ContainerCannotRun"})
# An unschedulable pod may be waiting for the cluster autoscaler: it fails only after this long.
UNSCHEDULABLE_GRACE_S = 300.0
# An OOM kill in a container's previous run counts only this long after it ended: an old one says
# nothing about the configuration running now.
RECENT_FAILURE_S = 1800.0


@dataclasses.dataclass(frozen=True)
class Failure:
    """A pod of the current configuration that fails: ``why``, since ``time`` (unix seconds: when it
    failed, else when the pod was created; None: unknown), and whether it is ``ready`` anyway (a
    container that was OOM-killed, restarted and serves again)."""

    pod: str
    why: str
    time: float | None = None
    ready: bool = False

    def __str__(self) -> str:
        return f"{self.pod}: {self.why}"


@dataclasses.dataclass(frozen=True)
class Target:
    """A ready engine pod to scrape: ``key`` (namespace/name/uid) identifies its metric series."""

    namespace: str
    name: str
    uid: str
    url: str

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}/{self.uid}"


@dataclasses.dataclass(frozen=True)
class PodSet:
    """One InferenceService's engine pods, classified.

    ``targets``: ready pods of the current configuration (a ready pod is scraped, whatever its past).
    ``failing``: the :class:`Failure` of each pod of the current configuration that cannot run, or
    was OOM-killed recently. ``waiting``: current pods not ready yet (starting).
    ``outdated``: pods still on a previous configuration.
    """

    targets: tuple[Target, ...] = ()
    failing: tuple[Failure, ...] = ()
    waiting: tuple[str, ...] = ()
    outdated: tuple[str, ...] = ()

    def problems(self) -> list[str]:
        """What keeps the set from describing the current configuration fully."""
        out = []
        if self.waiting:
            out.append(f"pod(s) not ready: {', '.join(self.waiting)}")
        if self.outdated:
            out.append(f"rollout in progress: {len(self.outdated)} pod(s) on the previous configuration")
        return out


def is_ready(pod: dict[str, Any]) -> bool:
    """The pod's Ready condition is True and it is not terminating."""
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def metrics_url(pod: dict[str, Any]) -> str | None:
    """``http://<pod IP>:<port named http>/metrics``, or None without an IP."""
    ip = (pod.get("status") or {}).get("podIP")
    if not ip:
        return None
    port = names.HTTP_PORT
    for container in (pod.get("spec") or {}).get("containers") or []:
        for item in container.get("ports") or []:
            if item.get("name") == names.HTTP_PORT_NAME and item.get("containerPort"):
                port = int(item["containerPort"])
    host = f"[{ip}]" if ":" in ip else ip
    return f"http://{host}:{port}{names.METRICS_PATH}"


def pod_failure(pod: dict[str, Any], now: float) -> str | None:
    """Why this pod cannot run its configuration (crash loop, OOM kill, image, unschedulable), or None."""
    status = pod.get("status") or {}
    for container in status.get("containerStatuses") or []:
        if container.get("name") != names.ENGINE_CONTAINER:
            continue
        state = container.get("state") or {}
        waiting = (state.get("waiting") or {}).get("reason")
        if waiting in FAILING_WAITING_REASONS:
            last = ((container.get("lastState") or {}).get("terminated") or {}).get("reason")
            return f"{waiting}" + (f" (last exit: {last})" if last else "")
        terminated = (state.get("terminated") or {}).get("reason")
        if terminated in FAILING_TERMINATED_REASONS:
            return f"terminated: {terminated}"
        last = (container.get("lastState") or {}).get("terminated") or {}
        if last.get("reason") == "OOMKilled":
            ended = last.get("finishedAt")
            if ended is None or now - parse_time(ended) <= RECENT_FAILURE_S:
                return f"OOMKilled ({container.get('restartCount', 0)} restart(s))"
    for condition in status.get("conditions") or []:
        if (
            condition.get("type") == "PodScheduled"
            and condition.get("status") == "False"
            and condition.get("reason") == "Unschedulable"
        ):
            since = condition.get("lastTransitionTime")
            pending = now - parse_time(since) if since else 0.0
            if pending >= UNSCHEDULABLE_GRACE_S:
                return f"unschedulable for {pending:.0f}s: {condition.get('message', '')}"[:200]
    return None


def failure_time(pod: dict[str, Any]) -> float | None:
    """When the engine container last failed (its termination, or an unschedulable pod's condition),
    else when the pod was created; None when the pod says neither."""
    status = pod.get("status") or {}
    times = []
    for container in status.get("containerStatuses") or []:
        if container.get("name") == names.ENGINE_CONTAINER:
            for state in (container.get("state") or {}, container.get("lastState") or {}):
                ended = (state.get("terminated") or {}).get("finishedAt")
                if ended:
                    times.append(parse_time(ended))
    for condition in status.get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("lastTransitionTime"):
            if condition.get("status") == "False":
                times.append(parse_time(condition["lastTransitionTime"]))
    created = (pod.get("metadata") or {}).get("creationTimestamp")
    if times:
        return max(times)
    return parse_time(created) if created else None


def _engine_container(pod_spec: dict[str, Any]) -> dict[str, Any]:
    containers = pod_spec.get("containers") or []
    return next((c for c in containers if c.get("name") == names.ENGINE_CONTAINER), {})


def runs_rendered(pod: dict[str, Any], rendered: dict[str, Any] | None) -> bool:
    """Whether the pod's engine container runs the image and env of ``rendered`` (the engine
    container of the pod template the operator renders; None: not checked). A field the pod does not
    show is not compared (the local platform's pods show their own args, not the rendered ones)."""
    if rendered is None:
        return True
    live = _engine_container(pod.get("spec") or {})
    return all(live[key] == rendered.get(key) for key in ("image", "env") if key in live)


def classify(
    pods: Iterable[dict[str, Any]],
    template_hash: str,
    now: float,
    template: dict[str, Any] | None = None,
) -> PodSet:
    """Sort one InferenceService's engine pods (see :class:`PodSet`). ``template``: the pod template
    the operator renders; a pod whose engine container differs from it is outdated."""
    rendered = _engine_container(template.get("spec") or {}) if template is not None else None
    targets, failing, waiting, outdated = [], [], [], []
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        meta = pod["metadata"]
        if meta.get("deletionTimestamp") or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue  # on its way out (scale-down, eviction): the ReplicaSet replaces what it must
        current = (meta.get("labels") or {}).get(names.LABEL_TEMPLATE_HASH) == template_hash
        if not current or not runs_rendered(pod, rendered):
            outdated.append(meta["name"])
            continue
        why = pod_failure(pod, now)
        url = metrics_url(pod)
        ready = is_ready(pod) and url is not None
        if why is not None:
            failing.append(Failure(meta["name"], why, failure_time(pod), ready))
        if ready:
            targets.append(Target(meta.get("namespace", ""), meta["name"], meta.get("uid", ""), url))
        elif why is None:
            waiting.append(meta["name"])
    return PodSet(tuple(targets), tuple(failing), tuple(waiting), tuple(outdated))
