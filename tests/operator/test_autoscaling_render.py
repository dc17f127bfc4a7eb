"""spec.autoscaling rendered: a HorizontalPodAutoscaler or a KEDA ScaledObject on the engine
Deployment, whose replicas the operator then never writes."""

from __future__ import annotations

import copy

import pytest

from kvpilot.operator.api.settings import resolve
from kvpilot.operator.api.spec import apply_defaults
from kvpilot.operator.reconcile.drift import needs_write
from kvpilot.operator.render.builders import build_children, build_deployment
from tests.operator.crd_schema import apply_schema_defaults, schema_errors

KEDA = {
    "keda": {"maxReplicaCount": 6, "prometheus": {"serverAddress": "http://prometheus.monitoring.svc:9090"}}
}


def by_kind(isvc: dict) -> dict[str, dict]:
    settings = resolve(isvc)
    assert settings.problems == ()
    return {c["kind"]: c for c in build_children(settings)}


def test_hpa_scales_the_deployment_on_the_waiting_queue_per_pod(make_isvc):
    children = by_kind(make_isvc(autoscaling={"hpa": {"minReplicas": 2, "maxReplicas": 8}}))
    hpa = children["HorizontalPodAutoscaler"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"] == {
        "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llama"},
        "minReplicas": 2,
        "maxReplicas": 8,
        "metrics": [
            {
                "type": "Pods",
                "pods": {
                    "metric": {"name": "vllm:num_requests_waiting"},
                    "target": {"type": "AverageValue", "averageValue": "4"},
                },
            }
        ],
    }
    assert "replicas" not in children["Deployment"]["spec"]
    assert "ScaledObject" not in children


def test_hpa_metric_and_target_are_the_users(make_isvc):
    spec = {"hpa": {"maxReplicas": 3, "metric": "vllm:kv_cache_usage_perc", "targetAverageValue": "800m"}}
    pods = by_kind(make_isvc(autoscaling=spec))["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]
    assert pods == {
        "metric": {"name": "vllm:kv_cache_usage_perc"},
        "target": {"type": "AverageValue", "averageValue": "800m"},
    }


def test_keda_scaled_object_has_a_prometheus_trigger_over_this_services_pods(make_isvc):
    children = by_kind(make_isvc(autoscaling=copy.deepcopy(KEDA)))
    scaled = children["ScaledObject"]
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llama"}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (0, 6)
    assert (spec["pollingInterval"], spec["cooldownPeriod"]) == (30, 300)
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus"
    meta = trigger["metadata"]
    assert meta["serverAddress"] == "http://prometheus.monitoring.svc:9090"
    match = 'namespace="llm",pod=~"llama-[a-z0-9]+-[a-z0-9]+"'
    assert meta["query"] == (
        f"sum(vllm:num_requests_waiting{{{match}}}) + sum(vllm:num_requests_running{{{match}}})"
    )
    assert meta["threshold"] == "8"
    assert "replicas" not in children["Deployment"]["spec"]


def test_keda_query_is_the_users_when_set(make_isvc):
    keda = copy.deepcopy(KEDA)
    keda["keda"]["prometheus"].update(query="sum(rate(x[1m]))", threshold="2.5")
    meta = by_kind(make_isvc(autoscaling=keda))["ScaledObject"]["spec"]["triggers"][0]["metadata"]
    assert (meta["query"], meta["threshold"]) == ("sum(rate(x[1m]))", "2.5")


def test_settings_name_the_autoscaler_for_remediation(make_isvc):
    assert resolve(make_isvc()).autoscaling_kind is None
    assert resolve(make_isvc(autoscaling={"hpa": {"maxReplicas": 2}})).autoscaling_kind == "hpa"
    assert resolve(make_isvc(autoscaling=copy.deepcopy(KEDA))).autoscaling_kind == "keda"


def test_a_scaled_deployment_is_not_drift_under_an_autoscaler(make_isvc):
    settings = resolve(make_isvc(autoscaling={"hpa": {"maxReplicas": 8}}))
    desired = build_deployment(settings)
    live = copy.deepcopy(desired)
    live["spec"]["replicas"] = 7  # what the HPA set
    assert not needs_write(desired, live)
    # Without an autoscaler the operator owns replicas and restores them.
    plain = build_deployment(resolve(make_isvc()))
    live = copy.deepcopy(plain)
    live["spec"]["replicas"] = 7
    assert needs_write(plain, live)


@pytest.mark.parametrize(
    "autoscaling",
    [
        KEDA,
        {"hpa": {"maxReplicas": 2}},
        {"hpa": {"minReplicas": 2, "maxReplicas": 2, "targetAverageValue": 3}},
    ],
)
def test_python_defaults_equal_the_crd_defaults(crd_schema, make_isvc, autoscaling):
    isvc = make_isvc(autoscaling=copy.deepcopy(autoscaling))
    assert schema_errors(isvc, crd_schema) == []
    by_api_server = apply_schema_defaults(copy.deepcopy({"spec": isvc["spec"]}), crd_schema)["spec"]
    assert apply_defaults(isvc["spec"])["autoscaling"] == by_api_server["autoscaling"]


@pytest.mark.parametrize(
    ("autoscaling", "message"),
    [
        ({}, "exactly one of autoscaling.keda or autoscaling.hpa"),
        ({**KEDA, "hpa": {"maxReplicas": 2}}, "exactly one of autoscaling.keda or autoscaling.hpa"),
        ({"hpa": {"minReplicas": 5, "maxReplicas": 2}}, "must not exceed hpa.maxReplicas"),
        ({"hpa": {"minReplicas": 0, "maxReplicas": 2}}, "minReplicas"),
        ({"keda": {**KEDA["keda"], "maxReplicaCount": 0}}, "maxReplicaCount"),
        ({"keda": {**KEDA["keda"], "minReplicaCount": 7}}, "must not exceed keda.maxReplicaCount"),
        ({"keda": {"maxReplicaCount": 2}}, "prometheus"),
        ({"keda": {**KEDA["keda"], "prometheus": {"serverAddress": "prometheus:9090"}}}, "serverAddress"),
    ],
)
def test_the_crd_refuses_bad_autoscaling_specs(crd_schema, make_isvc, autoscaling, message):
    errors = schema_errors(make_isvc(autoscaling=copy.deepcopy(autoscaling)), crd_schema)
    assert errors and any(message in e for e in errors), errors


def test_keda_may_scale_to_zero(crd_schema, make_isvc):
    isvc = make_isvc(autoscaling={"keda": {**copy.deepcopy(KEDA["keda"]), "minReplicaCount": 0}})
    assert schema_errors(isvc, crd_schema) == []
