"""spec.router and spec.autoscaling through one reconcile pass on the local API: the children are
applied, a kind whose CRD is missing is reported without blocking the rest, the engine Deployment
carries no replicas under an autoscaler, and removing the fields deletes what they rendered."""

from __future__ import annotations

from pathlib import Path

import yaml

from kvpilot.operator.api import names
from kvpilot.operator.api.rest import object_path
from tests.operator.kmock_apiserver import register_crd
from tests.operator.test_reconcile import NS, create, fresh, reconcile_once

CRDS = Path(__file__).resolve().parents[1] / "k8s" / "crds"
ROUTER = {
    "inferencePool": {"endpointPicker": {}, "httpRoute": {"gatewayName": "gw"}},
    "frontDoor": {},
}
HPA = {"hpa": {"minReplicas": 1, "maxReplicas": 4}}


def live(api, api_version: str, kind: str, name: str) -> dict | None:
    return api.get(object_path(api_version, kind, NS, name))


def test_a_missing_crd_is_named_and_the_rest_is_reconciled(api):
    create(api, "no-gie", router=ROUTER, autoscaling=HPA)
    outcome, events = reconcile_once(api, "no-gie")
    assert outcome.problems == outcome.conflicts == outcome.forbidden == []
    missing = {line.split(" ", 1)[0] for line in outcome.unavailable}
    # kmock's bundled discovery already serves the Gateway API's HTTPRoute; a real cluster may not.
    assert "InferencePool" in missing and missing <= {"InferencePool", "HTTPRoute"}
    assert any("Gateway API Inference Extension" in line for line in outcome.unavailable)
    assert ("Warning", "CRDMissing", outcome.unavailable[0]) in events
    for kind, name in [
        ("Deployment", "no-gie"),
        ("Deployment", "no-gie-epp"),
        ("Deployment", "no-gie-router"),
        ("Service", "no-gie-router"),
        ("Service", "no-gie-engines"),
        ("Service", "no-gie-epp"),
    ]:
        assert f"Created {kind} {name}" in outcome.written
    assert live(api, "autoscaling/v2", "HorizontalPodAutoscaler", "no-gie") is not None
    deployment = live(api, "apps/v1", "Deployment", "no-gie")
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    assert fresh(api, "no-gie")["status"]["conditions"]  # status still written


def test_with_the_crds_installed_every_child_exists_and_goes_with_its_field(api):
    for crd_file in CRDS.glob("*.yaml"):
        register_crd(api.server, yaml.safe_load(crd_file.read_text()))
    create(api, "gie", router=ROUTER, autoscaling=HPA)
    outcome, _ = reconcile_once(api, "gie")
    assert outcome.unavailable == []
    pool = live(api, "inference.networking.k8s.io/v1", "InferencePool", "gie")
    assert pool["spec"]["endpointPickerRef"]["name"] == "gie-epp"
    assert pool["metadata"]["ownerReferences"][0]["kind"] == names.KIND
    assert live(api, "gateway.networking.k8s.io/v1", "HTTPRoute", "gie") is not None

    first = outcome.pruned
    assert first is not None and ("keda.sh/v1alpha1", "ScaledObject", "gie") in first
    again, _ = reconcile_once(api, "gie", announce=False, pruned=first)
    assert again.written == [], "an unchanged object is not written again"
    assert again.pruned is None, "nothing changed since the last prune: a periodic pass skips it"

    # The fields removed: their children go, the engine's stay (and the Deployment gets replicas).
    isvc = fresh(api, "gie")
    spec = {k: v for k, v in isvc["spec"].items() if k not in ("router", "autoscaling")}
    path = object_path(names.API_VERSION, names.KIND, NS, "gie")
    api.merge_patch(path, {"spec": {"router": None, "autoscaling": None}})
    assert fresh(api, "gie")["spec"] == spec
    # A periodic pass prunes too once what the spec wants has changed since the last prune (the
    # announced pass of the change may have failed).
    outcome, _ = reconcile_once(api, "gie", announce=False, pruned=first)
    deleted = sorted(line for line in outcome.written if line.startswith("Deleted"))
    assert deleted == [
        "Deleted Deployment gie-epp",
        "Deleted Deployment gie-router",
        "Deleted HTTPRoute gie",
        "Deleted HorizontalPodAutoscaler gie",
        "Deleted InferencePool gie",
        "Deleted Service gie-engines",
        "Deleted Service gie-epp",
        "Deleted Service gie-router",
    ]
    assert live(api, "inference.networking.k8s.io/v1", "InferencePool", "gie") is None
    assert live(api, "apps/v1", "Deployment", "gie")["spec"]["replicas"] == spec["replicas"]
    assert live(api, "v1", "Service", "gie") is not None
    settled, _ = reconcile_once(api, "gie", announce=False, pruned=outcome.pruned)
    assert settled.pruned is None and not [line for line in settled.written if line.startswith("Deleted")]
