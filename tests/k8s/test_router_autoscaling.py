"""spec.router and spec.autoscaling against a real kube-apiserver: every object the builders render
is accepted by a server-side dry run under the published CRDs vendored in tests/k8s/crds/
(InferencePool of the Gateway API Inference Extension v1.6.2, HTTPRoute of the Gateway API v1.4.1,
ScaledObject of KEDA v2.19.0; the HorizontalPodAutoscaler is built in), a deliberately broken one of
each is refused (so the check can fail), and the operator reconciles an InferenceService with
router.inferencePool and autoscaling.hpa into those children."""

from __future__ import annotations

import copy
import json
import urllib.parse
from pathlib import Path

import pytest

from kvpilot.operator.api import names
from kvpilot.operator.api.rest import path_of
from kvpilot.operator.api.settings import resolve
from kvpilot.operator.render.builders import build_children
from tests.k8s.cluster import OPERATOR_TOKEN, Cluster
from tests.operator.conftest import OperatorProcess, wait_for

NS = "gie"
CRDS = Path(__file__).resolve().parent / "crds"
CRD_NAMES = ("inferencepools.inference.networking.k8s.io", "httproutes.gateway.networking.k8s.io",
             "scaledobjects.keda.sh")  # fmt: skip


def isvc(name: str, **spec) -> dict:
    body = {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "metadata": {"name": name, "namespace": NS, "uid": "0f3c3c8e-1111-4a5b-9c1d-000000000009"},
        "spec": {
            "model": {"source": "pvc://models/tiny"},
            "image": "kvpilot/engine:test",
            "replicas": 1,
            "resources": {"cpu": "1", "memory": "1Gi"},
            "engine": {"maxNumSeqs": 8, "maxModelLen": 256, "maxNumBatchedTokens": 256},
        },
    }
    body["spec"].update(spec)
    return body


FULL_ROUTER = {
    "inferencePool": {
        "endpointPicker": {"flags": [{"name": "secure-serving", "value": "false"}]},
        "httpRoute": {"gatewayName": "inference-gateway", "sectionName": "http"},
    },
    "frontDoor": {"resources": {"requests": {"cpu": "100m"}}},
}
KEDA = {"keda": {"maxReplicaCount": 4, "prometheus": {"serverAddress": "http://prometheus.monitoring:9090"}}}


@pytest.fixture(scope="module")
def gie_cluster(cluster: Cluster) -> Cluster:
    cluster.install_crd(NS)
    for crd in sorted(CRDS.glob("*.yaml")):
        cluster.kubectl("apply", "--server-side", "-f", str(crd))
    for name in CRD_NAMES:
        cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{name}")
    return cluster


def dry_run(cluster: Cluster, obj: dict) -> dict:
    """Server-side apply ``obj`` with ``dryRun=All``: the API server validates it and stores nothing."""
    query = urllib.parse.urlencode({"dryRun": "All", "fieldManager": "dry-run-test", "force": "true"})
    return cluster.request(
        "PATCH",
        f"{path_of(obj)}?{query}",
        json.dumps(obj),
        **{"Content-Type": "application/apply-patch+yaml"},
    )


def rendered(**spec) -> dict[str, dict]:
    settings = resolve(isvc("llama", **spec))
    assert settings.problems == ()
    return {child["kind"] + "/" + child["metadata"]["name"]: child for child in build_children(settings)}


@pytest.mark.parametrize(
    "spec",
    [
        {"router": FULL_ROUTER, "autoscaling": {"hpa": {"minReplicas": 1, "maxReplicas": 4}}},
        {"router": {"inferencePool": {"endpointPickerRef": {"name": "shared"}}}, "autoscaling": KEDA},
    ],
    ids=["pool+picker+route+front-door+hpa", "pool-by-ref+keda"],
)
def test_the_api_server_accepts_every_rendered_child(gie_cluster, spec):
    children = rendered(**copy.deepcopy(spec))
    for key, child in children.items():
        answer = dry_run(gie_cluster, child)
        assert "_status" not in answer, f"{key}: {answer.get('message') or answer}"
        assert answer["kind"] == child["kind"]
    assert gie_cluster.get(NS, "inferencepools.inference.networking.k8s.io/llama") is None, (
        "a dry run stores nothing"
    )


def _break(children: dict[str, dict], key: str, path: str, value) -> dict:
    obj = copy.deepcopy(children[key])
    *parents, last = path.split(".")
    node = obj
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    node[last] = value
    return obj


@pytest.mark.parametrize(
    ("key", "path", "value", "message"),
    [
        ("InferencePool/llama", "spec.targetPorts", [], "targetPorts"),
        ("InferencePool/llama", "spec.endpointPickerRef.failureMode", "Sometimes", "failureMode"),
        ("HTTPRoute/llama", "spec.rules.0.matches.0.path.type", "Glob", "path.type"),
        ("HorizontalPodAutoscaler/llama", "spec.maxReplicas", 0, "maxReplicas"),
        ("ScaledObject/llama", "spec.scaleTargetRef", {"kind": "Deployment"}, "name"),
    ],
)
def test_a_broken_child_is_refused(gie_cluster, key, path, value, message):
    children = rendered(router=copy.deepcopy(FULL_ROUTER), autoscaling=copy.deepcopy(KEDA))
    children.update(rendered(autoscaling={"hpa": {"maxReplicas": 3}}))
    answer = dry_run(gie_cluster, _break(children, key, path, value))
    assert answer.get("_status") == 422, answer
    assert message in answer["message"], answer["message"]


@pytest.fixture(scope="module")
def operator(gie_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory):
    proc = OperatorProcess(
        gie_cluster.identity(OPERATOR_TOKEN),
        tmp_path_factory.mktemp("operator"),
        [NS],
        ["--resync-interval", "1", "--liveness", ""],
    )
    yield proc
    proc.stop()
    print(f"\n--- operator log tail ---\n{proc.log[-4000:]}")


def test_the_operator_reconciles_a_pool_and_an_hpa(gie_cluster, operator):
    body = isvc(
        "served", router={"inferencePool": {"endpointPicker": {}}}, autoscaling={"hpa": {"maxReplicas": 3}}
    )
    del body["metadata"]["uid"]
    gie_cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
    pool = gie_cluster.wait_exists(NS, "inferencepools.inference.networking.k8s.io/served")
    hpa = gie_cluster.wait_exists(NS, "horizontalpodautoscalers.autoscaling/served")
    epp = gie_cluster.wait_exists(NS, "deployment/served-epp")
    deployment = gie_cluster.wait_exists(NS, "deployment/served")
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert pool["spec"]["selector"]["matchLabels"] == selector
    assert pool["spec"]["endpointPickerRef"]["name"] == "served-epp"
    assert hpa["spec"]["scaleTargetRef"]["name"] == "served"
    assert not selector.items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    for child in (pool, hpa, epp):
        assert child["metadata"]["ownerReferences"][0]["kind"] == names.KIND
    # The operator's field manager owns no replicas on the engine Deployment: the HPA does.
    managed = gie_cluster.request("GET", f"/apis/apps/v1/namespaces/{NS}/deployments/served")["metadata"]
    owned = [
        entry
        for entry in managed.get("managedFields") or []
        if entry["manager"] == names.FIELD_MANAGER and entry["operation"] == "Apply"
    ]
    assert owned and all("f:replicas" not in (e["fieldsV1"].get("f:spec") or {}) for e in owned)

    # Removing the fields deletes the pool, its picker and the HPA.
    gie_cluster.kubectl(
        "patch", "-n", NS, f"{names.PLURAL}/served", "--type=json",
        "-p", json.dumps([{"op": "remove", "path": f"/spec/{field}"} for field in ("router", "autoscaling")]),
    )  # fmt: skip
    wait_for(
        lambda: gie_cluster.get(NS, "inferencepools.inference.networking.k8s.io/served") is None,
        60,
        "pool gone",
    )
    wait_for(
        lambda: gie_cluster.get(NS, "horizontalpodautoscalers.autoscaling/served") is None, 60, "HPA gone"
    )
    wait_for(lambda: gie_cluster.get(NS, "deployment/served-epp") is None, 60, "picker gone")
