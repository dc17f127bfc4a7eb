"""Pure manifest builders: one resolved InferenceService (``api.settings.Settings``) -> child objects.

``build_children(settings)`` is what the operator applies and what ``kvpilot render`` prints. Each
child carries the recommended labels, an owner reference to the InferenceService (when the object has
a uid, i.e. it was read from a cluster) and a hash of its own desired state in
``serving.kvpilot.io/config-hash``: equal hashes mean there is nothing to write.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

from kvpilot.operator.api import live, names
from kvpilot.operator.api.settings import Settings
from kvpilot.operator.render.podspec import build_pod_spec

# A rollout stalls for real only after the startup probe's whole budget has passed.
PROGRESS_DEADLINE_MARGIN_S = 600


def content_hash(obj: Any) -> str:
    """A short, stable hash of a JSON-serialisable value."""
    encoded = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(encoded).hexdigest()[:16]


def selector_labels(isvc: dict[str, Any]) -> dict[str, str]:
    """The immutable Deployment selector (also the Service's and PDB's)."""
    return {names.LABEL_ISVC: isvc["metadata"]["name"], names.LABEL_COMPONENT: names.COMPONENT}


def selector_string(isvc: dict[str, Any]) -> str:
    """``status.selector`` for the scale subresource (what HPA and ``kubectl scale`` read)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(isvc).items()))


def common_labels(isvc: dict[str, Any]) -> dict[str, str]:
    """Labels every child carries."""
    return {
        names.LABEL_NAME: names.ENGINE_NAME,
        names.LABEL_INSTANCE: isvc["metadata"]["name"],
        names.LABEL_COMPONENT: names.COMPONENT,
        names.LABEL_PART_OF: "kvpilot",
        names.LABEL_MANAGED_BY: names.MANAGED_BY,
        names.LABEL_ISVC: isvc["metadata"]["name"],
    }


def owner_reference(isvc: dict[str, Any]) -> dict[str, Any]:
    """The controller reference that ties a child's lifetime to the InferenceService."""
    meta = isvc["metadata"]
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(isvc: dict[str, Any], api_version: str, kind: str) -> dict[str, Any]:
    meta = isvc["metadata"]
    metadata: dict[str, Any] = {"name": meta["name"]}
    if meta.get("namespace"):
        metadata["namespace"] = meta["namespace"]
    metadata["labels"] = common_labels(isvc)
    obj: dict[str, Any] = {"apiVersion": api_version, "kind": kind, "metadata": metadata}
    if meta.get("uid"):
        obj["metadata"]["ownerReferences"] = [owner_reference(isvc)]
    return obj


def _with_hash(obj: dict[str, Any]) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    obj["metadata"].setdefault("annotations", {})[names.ANNOTATION_CONFIG_HASH] = content_hash(obj)
    return obj


def build_deployment(settings: Settings) -> dict[str, Any]:
    """The engine Deployment: ``settings.effective.replicas`` pods running ``kvpilot serve`` (no
    ``replicas`` at all under ``spec.autoscaling``: the autoscaler sets them)."""
    isvc, spec, effective = settings.isvc, settings.spec, settings.effective
    pod = spec.get("pod") or {}
    pod_spec = build_pod_spec(spec, effective, isvc["metadata"]["name"])
    pod_labels = {**(pod.get("labels") or {}), **common_labels(isvc)}
    pod_annotations = {
        **(pod.get("annotations") or {}),
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(names.HTTP_PORT),
        "prometheus.io/path": names.METRICS_PATH,
        "kubectl.kubernetes.io/default-container": names.ENGINE_CONTAINER,
    }
    template = {"metadata": {"labels": pod_labels, "annotations": pod_annotations}, "spec": pod_spec}
    template["metadata"]["labels"][names.LABEL_TEMPLATE_HASH] = content_hash(template)
    deployment = _metadata(isvc, "apps/v1", "Deployment")
    deployment["spec"] = {
        "replicas": effective.replicas,
        "revisionHistoryLimit": 3,
        "progressDeadlineSeconds": int(spec["probes"]["startupTimeoutSeconds"]) + PROGRESS_DEADLINE_MARGIN_S,
        "selector": {"matchLabels": selector_labels(isvc)},
        # The defaults (maxSurge 0, maxUnavailable 1) replace pods in place: a rollout needs no
        # spare GPU, at the price of one replica less while each new pod loads its model.
        "strategy": {
            "type": "RollingUpdate",
            "rollingUpdate": {
                "maxSurge": spec["rollout"]["maxSurge"],
                "maxUnavailable": spec["rollout"]["maxUnavailable"],
            },
        },
        "template": template,
    }
    if settings.autoscaling_kind is not None:
        # The HPA or KEDA owns the replica count: server-side apply without the field leaves it to them.
        del deployment["spec"]["replicas"]
    return _with_hash(deployment)


def live_config_data(settings: Settings) -> dict[str, Any]:
    """The live values in force (``api.live.live_values``), as the engine applies them."""
    return live.live_values(settings.spec, settings.effective)


def build_live_config(settings: Settings) -> dict[str, Any]:
    """The ConfigMap with the live values in force (runtime kvpilot), which every engine pod applies at
    start (``kvpilot serve --live-config-file``): a pod started after a live change runs its values.
    Its content is not in the pod template, so changing it rolls nothing out."""
    config_map = _metadata(settings.isvc, "v1", "ConfigMap")
    config_map["metadata"]["name"] = names.live_config_name(settings.isvc["metadata"]["name"])
    text = json.dumps(live_config_data(settings), sort_keys=True)
    config_map["data"] = {names.LIVE_CONFIG_KEY: text + "\n"}
    return _with_hash(config_map)


def build_service(isvc: dict[str, Any]) -> dict[str, Any]:
    """The ClusterIP Service in front of the engine pods (port ``http``, 8000)."""
    service = _metadata(isvc, "v1", "Service")
    service["spec"] = {
        "type": "ClusterIP",
        "selector": selector_labels(isvc),
        "ports": [
            {
                "name": names.HTTP_PORT_NAME,
                "port": names.HTTP_PORT,
                "targetPort": names.HTTP_PORT_NAME,
                "protocol": "TCP",
                "appProtocol": "http",
            }
        ],
    }
    return _with_hash(service)


def build_pdb(isvc: dict[str, Any]) -> dict[str, Any]:
    """A PodDisruptionBudget: node drains evict at most one engine pod at a time."""
    pdb = _metadata(isvc, "policy/v1", "PodDisruptionBudget")
    pdb["spec"] = {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(isvc)}}
    return _with_hash(pdb)


def build_service_monitor(settings: Settings) -> dict[str, Any]:
    """A Prometheus Operator ServiceMonitor scraping ``/metrics`` on every engine pod."""
    isvc, monitoring = settings.isvc, settings.spec["monitoring"]["serviceMonitor"]
    monitor = _metadata(isvc, "monitoring.coreos.com/v1", "ServiceMonitor")
    monitor["metadata"]["labels"].update(monitoring.get("labels") or {})
    monitor["spec"] = {
        "selector": {"matchLabels": selector_labels(isvc)},
        "endpoints": [
            {"port": names.HTTP_PORT_NAME, "path": names.METRICS_PATH, "interval": monitoring["interval"]}
        ],
    }
    return _with_hash(monitor)


def service_monitor_enabled(settings: Settings) -> bool:
    """Whether ``spec.monitoring.serviceMonitor.enabled`` asks for a ServiceMonitor."""
    return bool(settings.spec["monitoring"]["serviceMonitor"]["enabled"])


def build_children(settings: Settings) -> list[dict[str, Any]]:
    """Every child object, in apply order. ``settings`` must be valid (``Settings.is_valid``)."""
    isvc = settings.isvc
    children = [build_deployment(settings), build_service(isvc), build_pdb(isvc)]
    if live.supports_live(settings.spec):
        # The pods mount it as optional: one that starts before it exists runs the start-up values.
        children.append(build_live_config(settings))
    if service_monitor_enabled(settings):
        children.append(build_service_monitor(settings))
    # Imported here: routing builds on this module's labels and owner reference.
    from kvpilot.operator.render.routing import build_routing_children

    children += [_with_hash(child) for child in build_routing_children(settings)]
    return children


def build_event(
    isvc: dict[str, Any], type_: str, reason: str, message: str, now: str, suffix: str
) -> dict[str, Any]:
    """A core/v1 Event about ``isvc`` (``now``: an RFC 3339 time; ``suffix`` makes the name unique)."""
    meta = isvc["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{meta['name']}.{suffix}", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": names.API_VERSION,
            "kind": names.KIND,
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid", ""),
            "resourceVersion": meta.get("resourceVersion", ""),
        },
        "type": type_,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": names.MANAGED_BY},
        "reportingComponent": f"{names.GROUP}/operator",
        "reportingInstance": names.MANAGED_BY,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
