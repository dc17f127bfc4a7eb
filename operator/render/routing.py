"""Pure builders for ``spec.router`` and ``spec.autoscaling``: one resolved InferenceService
(``api.settings.Settings``) -> the extra children they ask for.

``spec.router.inferencePool``: an InferencePool (Gateway API Inference Extension v1.6.2,
``inference.networking.k8s.io/v1``) over the engine pods on the engine port, pointing at an endpoint
picker; with ``endpointPicker`` also that picker's Deployment and Service (the extension's lightweight
EPP image, started with the flags its conformance manifests give it), with ``httpRoute`` an HTTPRoute
(``gateway.networking.k8s.io/v1``) whose backend is the pool. ``spec.router.frontDoor``: kvpilot's own
router (``kvpilot router``) as a Deployment and a Service, plus a headless Service over the engine pods
that the router resolves to find each pod. ``spec.autoscaling``: a HorizontalPodAutoscaler
(``autoscaling/v2``) or a KEDA ScaledObject (``keda.sh/v1alpha1``) on the engine Deployment.

Router and endpoint-picker pods carry a component label of their own, so the engine Deployment's,
Service's and PDB's selector never matches them.
"""

from __future__ import annotations

import copy
from typing import Any

from kvpilot.engine.metrics_names import NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING
from kvpilot.operator.api import names
from kvpilot.operator.api.settings import Settings
from kvpilot.operator.render.builders import common_labels, owner_reference, selector_labels
from kvpilot.operator.render.wake import RBAC_API_VERSION, build_router_access, router_wakes, wake_target

# What the Gateway API Inference Extension v1.6.2 publishes: its API group and its endpoint picker.
INFERENCE_GROUP = "inference.networking.k8s.io"
INFERENCE_POOL_API_VERSION = f"{INFERENCE_GROUP}/v1"
HTTP_ROUTE_API_VERSION = "gateway.networking.k8s.io/v1"
SCALED_OBJECT_API_VERSION = "keda.sh/v1alpha1"
HPA_API_VERSION = "autoscaling/v2"
DEFAULT_EPP_IMAGE = "registry.k8s.io/gateway-api-inference-extension/lwepp:v1.6.2"
# The endpoint picker's other ports (its gRPC health service and its Prometheus metrics), as the
# extension's own defaults and manifests have them; its health service is named so.
EPP_HEALTH_PORT = 9003
EPP_METRICS_PORT = 9090
EPP_HEALTH_SERVICE = "inference-extension"
EPP_CONTAINER = "epp"
ROUTER_CONTAINER = "router"

COMPONENT_EPP = "endpoint-picker"
COMPONENT_ROUTER = "router"
# The kinds only these builders render, in apply order (what the reconciler prunes when unset).
OPTIONAL_KINDS = (
    ("v1", "Service", "engines"),
    ("v1", "ServiceAccount", "router"),
    (RBAC_API_VERSION, "Role", "router"),
    (RBAC_API_VERSION, "RoleBinding", "router"),
    ("apps/v1", "Deployment", "router"),
    ("v1", "Service", "router"),
    ("apps/v1", "Deployment", "epp"),
    ("v1", "Service", "epp"),
    (INFERENCE_POOL_API_VERSION, "InferencePool", ""),
    (HTTP_ROUTE_API_VERSION, "HTTPRoute", ""),
    (HPA_API_VERSION, "HorizontalPodAutoscaler", ""),
    (SCALED_OBJECT_API_VERSION, "ScaledObject", ""),
)
# Kinds whose CRD a cluster may lack (the reconciler reports that instead of failing the pass).
CRD_KINDS = {
    "InferencePool": "the Gateway API Inference Extension",
    "HTTPRoute": "the Gateway API",
    "ScaledObject": "KEDA",
}

_CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
}
_POD_SECURITY = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}


def child_name(isvc: dict[str, Any], suffix: str) -> str:
    """The name of a child: the InferenceService's, with ``-suffix`` when one is given."""
    name = isvc["metadata"]["name"]
    return f"{name}-{suffix}" if suffix else name


def engines_service_name(isvc: dict[str, Any]) -> str:
    """The headless Service over the engine pods (one DNS record per ready pod)."""
    return child_name(isvc, "engines")


def epp_service_name(isvc: dict[str, Any]) -> str:
    """The endpoint picker's Service that ``spec.router.inferencePool.endpointPicker`` renders."""
    return child_name(isvc, "epp")


def _selector(isvc: dict[str, Any], component: str) -> dict[str, str]:
    return {names.LABEL_ISVC: isvc["metadata"]["name"], names.LABEL_COMPONENT: component}


def _object(settings: Settings, api_version: str, kind: str, suffix: str = "", component: str = "") -> dict:
    isvc = settings.isvc
    meta = isvc["metadata"]
    labels = common_labels(isvc)
    if component:
        labels[names.LABEL_COMPONENT] = component
        labels[names.LABEL_NAME] = f"kvpilot-{component}"
    metadata: dict[str, Any] = {"name": child_name(isvc, suffix)}
    if meta.get("namespace"):
        metadata["namespace"] = meta["namespace"]
    metadata["labels"] = labels
    if meta.get("uid"):
        metadata["ownerReferences"] = [owner_reference(isvc)]
    return {"apiVersion": api_version, "kind": kind, "metadata": metadata}


def _namespace(settings: Settings) -> str:
    return settings.isvc["metadata"].get("namespace") or "default"


def _small_deployment(
    settings: Settings, suffix: str, component: str, replicas: int, pod_spec: dict[str, Any]
) -> dict[str, Any]:
    deployment = _object(settings, "apps/v1", "Deployment", suffix, component)
    selector = _selector(settings.isvc, component)
    deployment["spec"] = {
        "replicas": replicas,
        "revisionHistoryLimit": 3,
        "selector": {"matchLabels": selector},
        "template": {"metadata": {"labels": dict(deployment["metadata"]["labels"])}, "spec": pod_spec},
    }
    return deployment


def _resources(config: dict[str, Any]) -> dict[str, Any]:
    resources = config.get("resources") or {}
    return {key: dict(resources[key]) for key in ("requests", "limits") if resources.get(key)}


# --- spec.router.inferencePool ------------------------------------------------------------------


def build_inference_pool(settings: Settings) -> dict[str, Any]:
    """The InferencePool over the engine pods (the engine Deployment's selector, the engine port)."""
    pool_spec = settings.spec["router"]["inferencePool"]
    if "endpointPicker" in pool_spec:
        ref_name, ref_port = epp_service_name(settings.isvc), pool_spec["endpointPicker"]["port"]
    else:
        ref = pool_spec.get("endpointPickerRef") or {}
        ref_name, ref_port = ref.get("name") or epp_service_name(settings.isvc), ref.get("port", 9002)
    pool = _object(settings, INFERENCE_POOL_API_VERSION, "InferencePool")
    pool["spec"] = {
        "selector": {"matchLabels": selector_labels(settings.isvc)},
        "targetPorts": [{"number": names.HTTP_PORT}],
        "endpointPickerRef": {
            "group": "",
            "kind": "Service",
            "name": ref_name,
            "port": {"number": int(ref_port)},
            "failureMode": pool_spec["failureMode"],
        },
    }
    return pool


def build_epp_deployment(settings: Settings) -> dict[str, Any]:
    """The endpoint picker for the pool: ``lwepp --pool-name <name> --pool-namespace <ns>`` plus the
    ports it listens on and the user's extra ``flags``."""
    picker = settings.spec["router"]["inferencePool"]["endpointPicker"]
    args = [
        "--pool-name", settings.isvc["metadata"]["name"],
        "--pool-namespace", _namespace(settings),
        "--grpc-port", str(picker["port"]),
        "--grpc-health-port", str(EPP_HEALTH_PORT),
        "--metrics-port", str(EPP_METRICS_PORT),
    ]  # fmt: skip
    for flag in picker.get("flags") or []:
        args += [f"--{flag['name']}", str(flag["value"])]
    probe = {
        "grpc": {"port": EPP_HEALTH_PORT, "service": EPP_HEALTH_SERVICE},
        "initialDelaySeconds": 5,
        "periodSeconds": 10,
    }
    container: dict[str, Any] = {
        "name": EPP_CONTAINER,
        "image": picker.get("image") or DEFAULT_EPP_IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "args": args,
        "ports": [
            {"name": "grpc", "containerPort": int(picker["port"]), "protocol": "TCP"},
            {"name": "grpc-health", "containerPort": EPP_HEALTH_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": EPP_METRICS_PORT, "protocol": "TCP"},
        ],
        "env": [{"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
        "livenessProbe": probe,
        "readinessProbe": copy.deepcopy(probe),
        "securityContext": copy.deepcopy(_CONTAINER_SECURITY),
    }
    if _resources(picker):
        container["resources"] = _resources(picker)
    pod_spec: dict[str, Any] = {
        # As long as the longest grace period of the engine pods it routes to.
        "terminationGracePeriodSeconds": int(settings.spec["pod"]["terminationGracePeriodSeconds"]),
        "securityContext": copy.deepcopy(_POD_SECURITY),
        "containers": [container],
    }
    if picker.get("serviceAccountName"):
        pod_spec["serviceAccountName"] = picker["serviceAccountName"]
    return _small_deployment(settings, "epp", COMPONENT_EPP, int(picker["replicas"]), pod_spec)


def build_epp_service(settings: Settings) -> dict[str, Any]:
    """The endpoint picker's Service, which the pool's ``endpointPickerRef`` names (gRPC, HTTP/2)."""
    port = int(settings.spec["router"]["inferencePool"]["endpointPicker"]["port"])
    service = _object(settings, "v1", "Service", "epp", COMPONENT_EPP)
    service["spec"] = {
        "type": "ClusterIP",
        "selector": _selector(settings.isvc, COMPONENT_EPP),
        "ports": [
            {"name": "grpc", "port": port, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "http2"}
        ],
    }
    return service


def build_http_route(settings: Settings) -> dict[str, Any]:
    """An HTTPRoute from the named Gateway to the InferencePool (under ``pathPrefix``)."""
    route_spec = settings.spec["router"]["inferencePool"]["httpRoute"]
    parent: dict[str, Any] = {
        "group": "gateway.networking.k8s.io",
        "kind": "Gateway",
        "name": route_spec["gatewayName"],
    }
    if route_spec.get("gatewayNamespace"):
        parent["namespace"] = route_spec["gatewayNamespace"]
    if route_spec.get("sectionName"):
        parent["sectionName"] = route_spec["sectionName"]
    route = _object(settings, HTTP_ROUTE_API_VERSION, "HTTPRoute")
    route["spec"] = {
        "parentRefs": [parent],
        "rules": [
            {
                "matches": [{"path": {"type": "PathPrefix", "value": route_spec["pathPrefix"]}}],
                "backendRefs": [
                    {
                        "group": INFERENCE_GROUP,
                        "kind": "InferencePool",
                        "name": settings.isvc["metadata"]["name"],
                    }
                ],
            }
        ],
    }
    return route


# --- spec.router.frontDoor ----------------------------------------------------------------------


def build_engines_service(settings: Settings) -> dict[str, Any]:
    """A headless Service over the engine pods: ``<name>-engines.<ns>.svc`` resolves to each ready
    pod's address, which is how the router finds its backends."""
    service = _object(settings, "v1", "Service", "engines")
    service["spec"] = {
        "clusterIP": "None",
        "selector": selector_labels(settings.isvc),
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
    return service


def router_command(settings: Settings) -> list[str]:
    """``kvpilot router --listen 0.0.0.0:<port> --backends-dns <headless>.<ns>.svc:<engine port>``."""
    port = int(settings.spec["router"]["frontDoor"]["port"])
    backends = f"{engines_service_name(settings.isvc)}.{_namespace(settings)}.svc:{names.HTTP_PORT}"
    command = ["kvpilot", "router", "--listen", f"0.0.0.0:{port}", "--backends-dns", backends]
    if router_wakes(settings):  # scale to zero: held requests ask for a replica
        command += ["--wake", wake_target(settings)]
    return command


def build_router_deployment(settings: Settings) -> dict[str, Any]:
    """kvpilot's router in front of the engine pods (image: ``frontDoor.image``, resolved to the
    operator's router image when unset)."""
    door = settings.spec["router"]["frontDoor"]
    port = int(door["port"])
    command = router_command(settings)
    container: dict[str, Any] = {
        "name": ROUTER_CONTAINER,
        "image": door["image"],
        "imagePullPolicy": settings.spec["imagePullPolicy"],
        "command": command[:1],
        "args": command[1:],
        "ports": [{"name": names.HTTP_PORT_NAME, "containerPort": port, "protocol": "TCP"}],
        "readinessProbe": {"tcpSocket": {"port": names.HTTP_PORT_NAME}, "periodSeconds": 5},
        "securityContext": copy.deepcopy(_CONTAINER_SECURITY),
    }
    if _resources(door):
        container["resources"] = _resources(door)
    pod_spec: dict[str, Any] = {"securityContext": copy.deepcopy(_POD_SECURITY), "containers": [container]}
    if router_wakes(settings):  # its token may stamp wake-requested-at on this InferenceService alone
        pod_spec["serviceAccountName"] = child_name(settings.isvc, "router")
        pod_spec["automountServiceAccountToken"] = True
    else:
        pod_spec["automountServiceAccountToken"] = False  # the router never talks to the API then
    return _small_deployment(settings, "router", COMPONENT_ROUTER, int(door["replicas"]), pod_spec)


def build_router_service(settings: Settings) -> dict[str, Any]:
    """The ClusterIP Service clients reach the router by (``<name>-router``, port ``frontDoor.port``)."""
    port = int(settings.spec["router"]["frontDoor"]["port"])
    service = _object(settings, "v1", "Service", "router", COMPONENT_ROUTER)
    service["spec"] = {
        "type": "ClusterIP",
        "selector": _selector(settings.isvc, COMPONENT_ROUTER),
        "ports": [
            {
                "name": names.HTTP_PORT_NAME,
                "port": port,
                "targetPort": names.HTTP_PORT_NAME,
                "protocol": "TCP",
                "appProtocol": "http",
            }
        ],
    }
    return service


# --- spec.autoscaling ---------------------------------------------------------------------------


def _scale_target(settings: Settings) -> dict[str, str]:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": settings.isvc["metadata"]["name"]}


def build_hpa(settings: Settings) -> dict[str, Any]:
    """A HorizontalPodAutoscaler holding the per-pod average of ``hpa.metric`` (a Pods metric, from a
    custom-metrics adapter) at ``hpa.targetAverageValue``."""
    hpa_spec = settings.spec["autoscaling"]["hpa"]
    hpa = _object(settings, HPA_API_VERSION, "HorizontalPodAutoscaler")
    hpa["spec"] = {
        "scaleTargetRef": _scale_target(settings),
        "minReplicas": int(hpa_spec["minReplicas"]),
        "maxReplicas": int(hpa_spec["maxReplicas"]),
        "metrics": [
            {
                "type": "Pods",
                "pods": {
                    "metric": {"name": hpa_spec["metric"]},
                    "target": {"type": "AverageValue", "averageValue": str(hpa_spec["targetAverageValue"])},
                },
            }
        ],
    }
    return hpa


def default_keda_query(settings: Settings) -> str:
    """The requests waiting plus running over this InferenceService's engine pods (their names are
    ``<name>-<replicaset hash>-<suffix>``, which no router or endpoint-picker pod's matches)."""
    meta = settings.isvc["metadata"]
    match = f'namespace="{meta.get("namespace") or "default"}",pod=~"{meta["name"]}-[a-z0-9]+-[a-z0-9]+"'
    return f"sum({NUM_REQUESTS_WAITING}{{{match}}}) + sum({NUM_REQUESTS_RUNNING}{{{match}}})"


def build_scaled_object(settings: Settings) -> dict[str, Any]:
    """A KEDA ScaledObject on the engine Deployment with one Prometheus trigger (per-pod threshold)."""
    keda = settings.spec["autoscaling"]["keda"]
    prometheus = keda["prometheus"]
    scaled = _object(settings, SCALED_OBJECT_API_VERSION, "ScaledObject")
    scaled["spec"] = {
        "scaleTargetRef": _scale_target(settings),
        "pollingInterval": int(keda["pollingInterval"]),
        "cooldownPeriod": int(keda["cooldownPeriod"]),
        "minReplicaCount": int(keda["minReplicaCount"]),
        "maxReplicaCount": int(keda["maxReplicaCount"]),
        "triggers": [
            {
                "type": "prometheus",
                "metadata": {
                    "serverAddress": prometheus["serverAddress"],
                    "query": prometheus.get("query") or default_keda_query(settings),
                    "threshold": str(prometheus["threshold"]),
                },
            }
        ],
    }
    return scaled


def build_routing_children(settings: Settings) -> list[dict[str, Any]]:
    """What ``spec.router`` and ``spec.autoscaling`` ask for, in apply order, without config hashes
    (``builders.build_children`` adds them)."""
    spec = settings.spec
    router = spec.get("router") or {}
    children: list[dict[str, Any]] = []
    if "frontDoor" in router:
        children.append(build_engines_service(settings))
        if router_wakes(settings):
            children += build_router_access(
                settings,
                lambda api_version, kind: _object(settings, api_version, kind, "router", COMPONENT_ROUTER),
            )
        children += [build_router_deployment(settings), build_router_service(settings)]
    pool = router.get("inferencePool")
    if pool is not None:
        if "endpointPicker" in pool:
            children += [build_epp_deployment(settings), build_epp_service(settings)]
        children.append(build_inference_pool(settings))
        if "httpRoute" in pool:
            children.append(build_http_route(settings))
    if settings.autoscaling_kind == "hpa":
        children.append(build_hpa(settings))
    elif settings.autoscaling_kind == "keda":
        children.append(build_scaled_object(settings))
    return children


def unwanted_children(settings: Settings, wanted: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(apiVersion, kind, name) of every kind these builders may render that ``wanted`` lacks: the
    children to delete (when the operator owns them) once their field is removed from the spec."""
    have = {(c["apiVersion"], c["kind"], c["metadata"]["name"]) for c in wanted}
    out = []
    for api_version, kind, suffix in OPTIONAL_KINDS:
        key = (api_version, kind, child_name(settings.isvc, suffix))
        if key not in have:
            out.append(key)
    return out
