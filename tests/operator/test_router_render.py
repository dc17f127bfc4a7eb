"""spec.router rendered: the InferencePool (with its endpoint picker and HTTPRoute) and kvpilot's own
front door, their defaults and the CRD's rules for them."""

from __future__ import annotations

import copy

import pytest

from kvpilot.operator.api import names
from kvpilot.operator.api.platform import DEFAULT_ROUTER_IMAGE, Platform
from kvpilot.operator.api.settings import resolve
from kvpilot.operator.api.spec import apply_defaults
from kvpilot.operator.render.builders import build_children, selector_labels
from kvpilot.operator.render.routing import DEFAULT_EPP_IMAGE, unwanted_children
from tests.operator.crd_schema import apply_schema_defaults, schema_errors

POOL = {"inferencePool": {"endpointPicker": {}, "httpRoute": {"gatewayName": "inference-gateway"}}}


def children_of(isvc: dict, platform: Platform | None = None) -> dict[tuple[str, str], dict]:
    settings = resolve(isvc, platform or Platform())
    assert settings.problems == ()
    return {(c["kind"], c["metadata"]["name"]): c for c in build_children(settings)}


def test_inference_pool_selects_the_engine_pods_on_the_engine_port(make_isvc):
    isvc = make_isvc(router=copy.deepcopy(POOL))
    children = children_of(isvc)
    pool = children[("InferencePool", "llama")]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    engine = children[("Deployment", "llama")]
    assert pool["spec"]["selector"]["matchLabels"] == engine["spec"]["selector"]["matchLabels"]
    assert (
        pool["spec"]["selector"]["matchLabels"].items()
        <= engine["spec"]["template"]["metadata"]["labels"].items()
    )
    assert pool["spec"]["targetPorts"] == [{"number": names.HTTP_PORT}]
    assert pool["spec"]["endpointPickerRef"] == {
        "group": "",
        "kind": "Service",
        "name": "llama-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    assert pool["metadata"]["ownerReferences"][0]["uid"] == isvc["metadata"]["uid"]
    assert names.ANNOTATION_CONFIG_HASH in pool["metadata"]["annotations"]


def test_endpoint_picker_runs_the_extensions_image_for_this_pool(make_isvc):
    router = copy.deepcopy(POOL)
    router["inferencePool"]["endpointPicker"] = {
        "flags": [{"name": "secure-serving", "value": "false"}],
        "serviceAccountName": "epp",
        "resources": {"requests": {"cpu": "500m"}},
    }
    children = children_of(make_isvc(router=router))
    epp = children[("Deployment", "llama-epp")]
    (container,) = epp["spec"]["template"]["spec"]["containers"]
    assert (
        container["image"]
        == DEFAULT_EPP_IMAGE
        == "registry.k8s.io/gateway-api-inference-extension/lwepp:v1.6.2"
    )
    args = container["args"]
    assert args[:4] == ["--pool-name", "llama", "--pool-namespace", "llm"]
    assert args[-2:] == ["--secure-serving", "false"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "grpc": 9002,
        "grpc-health": 9003,
        "metrics": 9090,
    }
    assert container["readinessProbe"]["grpc"] == {"port": 9003, "service": "inference-extension"}
    assert container["resources"] == {"requests": {"cpu": "500m"}}
    assert epp["spec"]["template"]["spec"]["serviceAccountName"] == "epp"
    # Its pods are not engine pods: the engine Deployment's, Service's and pool's selector miss them.
    labels = epp["spec"]["template"]["metadata"]["labels"]
    assert not selector_labels(make_isvc()).items() <= labels.items()
    service = children[("Service", "llama-epp")]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["port"] == 9002


def test_without_a_picker_the_pool_points_at_the_named_one(make_isvc):
    router = {"inferencePool": {"endpointPickerRef": {"name": "shared-epp"}, "failureMode": "FailOpen"}}
    children = children_of(make_isvc(router=router))
    ref = children[("InferencePool", "llama")]["spec"]["endpointPickerRef"]
    assert (ref["name"], ref["port"], ref["failureMode"]) == ("shared-epp", {"number": 9002}, "FailOpen")
    assert ("Deployment", "llama-epp") not in children
    assert ("HTTPRoute", "llama") not in children


def test_http_route_sends_the_gateways_traffic_to_the_pool(make_isvc):
    router = copy.deepcopy(POOL)
    router["inferencePool"]["httpRoute"].update(gatewayNamespace="gateways", sectionName="https")
    route = children_of(make_isvc(router=router))[("HTTPRoute", "llama")]
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] == [
        {
            "group": "gateway.networking.k8s.io",
            "kind": "Gateway",
            "name": "inference-gateway",
            "namespace": "gateways",
            "sectionName": "https",
        }
    ]
    (rule,) = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "llama"}
    ]


def test_front_door_runs_kvpilot_router_over_a_headless_service(make_isvc):
    children = children_of(make_isvc(router={"frontDoor": {}}))
    headless = children[("Service", "llama-engines")]
    assert headless["spec"]["clusterIP"] == "None"
    assert (
        headless["spec"]["selector"] == children[("Deployment", "llama")]["spec"]["selector"]["matchLabels"]
    )
    router = children[("Deployment", "llama-router")]
    assert router["spec"]["replicas"] == 1
    (container,) = router["spec"]["template"]["spec"]["containers"]
    assert container["image"] == DEFAULT_ROUTER_IMAGE
    assert [*container["command"], *container["args"]] == [
        "kvpilot", "router", "--listen", "0.0.0.0:8000", "--backends-dns", "llama-engines.llm.svc:8000",
    ]  # fmt: skip
    labels = router["spec"]["template"]["metadata"]["labels"]
    assert labels[names.LABEL_COMPONENT] == "router"
    assert not children[("Service", "llama")]["spec"]["selector"].items() <= labels.items()
    service = children[("Service", "llama-router")]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["port"] == 8000


def test_with_scale_to_zero_the_router_may_wake_its_service_alone(make_isvc):
    children = children_of(make_isvc(router={"frontDoor": {}}, remediation={"limits": {"minReplicas": 0}}))
    pod = children[("Deployment", "llama-router")]["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[-2:] == ["--wake", "llm/llama"]
    assert (pod["serviceAccountName"], pod["automountServiceAccountToken"]) == ("llama-router", True)
    account = children[("ServiceAccount", "llama-router")]
    assert account["automountServiceAccountToken"] is False  # only the router pod mounts its token
    (rule,) = children[("Role", "llama-router")]["rules"]
    assert rule == {
        "apiGroups": [names.GROUP],
        "resources": [names.PLURAL],
        "resourceNames": ["llama"],
        "verbs": ["get", "patch"],
    }
    binding = children[("RoleBinding", "llama-router")]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "llama-router",
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llama-router", "namespace": "llm"}]
    for key in (
        ("ServiceAccount", "llama-router"),
        ("Role", "llama-router"),
        ("RoleBinding", "llama-router"),
    ):
        assert children[key]["metadata"]["ownerReferences"][0]["kind"] == names.KIND
    # Without scale to zero, or with an autoscaler owning replicas: no grant, no token, no --wake.
    for spec in (
        {"router": {"frontDoor": {}}},
        {
            "router": {"frontDoor": {}},
            "remediation": {"limits": {"minReplicas": 0}},
            "autoscaling": {"hpa": {"maxReplicas": 4}},
        },
    ):
        children = children_of(make_isvc(**copy.deepcopy(spec)))
        pod = children[("Deployment", "llama-router")]["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False and "--wake" not in pod["containers"][0]["args"]
        assert not {k for k in children if k[0] in ("ServiceAccount", "Role", "RoleBinding")}


def test_front_door_image_port_and_replicas_are_the_users(make_isvc):
    door = {"replicas": 3, "port": 9000, "image": "registry.example.com/kvpilot/operator:1"}
    children = children_of(make_isvc(router={"frontDoor": door}))
    router = children[("Deployment", "llama-router")]
    (container,) = router["spec"]["template"]["spec"]["containers"]
    assert (router["spec"]["replicas"], container["image"]) == (3, door["image"])
    assert container["args"][2] == "0.0.0.0:9000"
    assert children[("Service", "llama-router")]["spec"]["ports"][0]["port"] == 9000
    # Unset, the operator's router image (the chart passes its own image).
    platform = Platform(router_image="registry.example.com/ops/kvpilot:2")
    unset = children_of(make_isvc(router={"frontDoor": {}}), platform)[("Deployment", "llama-router")]
    assert unset["spec"]["template"]["spec"]["containers"][0]["image"] == "registry.example.com/ops/kvpilot:2"


def test_nothing_extra_without_spec_router_and_every_optional_child_is_prunable(make_isvc):
    plain = resolve(make_isvc())
    kinds = sorted(c["kind"] for c in build_children(plain))
    assert kinds == ["ConfigMap", "Deployment", "PodDisruptionBudget", "Service"]
    # Everything spec.router can render is on the prune list once the field is gone...
    full = resolve(
        make_isvc(router={**copy.deepcopy(POOL), "frontDoor": {}}, autoscaling={"hpa": {"maxReplicas": 4}})
    )
    woken = resolve(make_isvc(router={"frontDoor": {}}, remediation={"limits": {"minReplicas": 0}}))
    woken_extra = {(c["apiVersion"], c["kind"], c["metadata"]["name"]) for c in build_children(woken)}
    assert {kind for _, kind, _ in woken_extra} >= {"ServiceAccount", "Role", "RoleBinding"}
    extra = {(c["apiVersion"], c["kind"], c["metadata"]["name"]) for c in build_children(full)} - {
        (c["apiVersion"], c["kind"], c["metadata"]["name"]) for c in build_children(plain)
    }
    assert extra <= set(unwanted_children(plain, build_children(plain)))
    woken_extra -= {(c["apiVersion"], c["kind"], c["metadata"]["name"]) for c in build_children(plain)}
    assert woken_extra <= set(unwanted_children(plain, build_children(plain)))
    # ...and nothing the full spec wants is.
    assert not extra & set(unwanted_children(full, build_children(full)))


@pytest.mark.parametrize(
    "router",
    [
        POOL,
        {"inferencePool": {}},
        {"frontDoor": {"resources": {"limits": {"cpu": 1, "memory": "256Mi"}}}},
        {"inferencePool": {"endpointPickerRef": {"name": "e", "port": 9100}}, "frontDoor": {"port": 9000}},
    ],
)
def test_python_defaults_equal_the_crd_defaults(crd_schema, make_isvc, router):
    isvc = make_isvc(router=copy.deepcopy(router))
    assert schema_errors(isvc, crd_schema) == []
    by_api_server = apply_schema_defaults(copy.deepcopy({"spec": isvc["spec"]}), crd_schema)["spec"]
    assert apply_defaults(isvc["spec"])["router"] == by_api_server["router"]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"spec.router.inferencePool": {"endpointPicker": {}, "endpointPickerRef": {"name": "x"}}},
            "not both",
        ),
        ({"spec.router.frontDoor": {}, "metadata.name": "n" * 56}, "at most 55 characters"),
        ({"spec.router.inferencePool": {"endpointPicker": {}}, "metadata.name": "n" * 60}, "at most 59"),
        ({"spec.router.inferencePool": {"httpRoute": {}}}, "gatewayName"),
        ({"spec.router.frontDoor": {"replicas": 0}}, "replicas"),
        ({"spec.router.inferencePool": {"failureMode": "Maybe"}}, "failureMode"),
    ],
)
def test_the_crd_refuses_bad_router_specs(crd_schema, make_isvc, changes, message):
    errors = schema_errors(make_isvc(changes), crd_schema)
    assert errors and any(message in e for e in errors), errors


def test_the_router_image_comes_from_the_flag_else_the_charts_environment():
    import argparse

    from kvpilot.operator.cli import platform_from

    env = {"KVPILOT_ROUTER_IMAGE": "mirror.corp/kvpilot/operator:3"}
    assert (
        platform_from(argparse.Namespace(router_image=None), env).router_image == env["KVPILOT_ROUTER_IMAGE"]
    )
    assert platform_from(argparse.Namespace(router_image="a/b:1"), env).router_image == "a/b:1"
    assert platform_from(argparse.Namespace(), {}).router_image == DEFAULT_ROUTER_IMAGE
