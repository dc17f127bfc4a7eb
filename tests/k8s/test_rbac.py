"""The operator under the chart's own RBAC on a real API server: with the token of the chart's
ServiceAccount it reconciles, writes status and posts Events without one refused request; with one
verb taken from its ClusterRole it fails in a way its log and a condition name."""

from __future__ import annotations

import asyncio
import copy
import json
import subprocess
import time

import pytest
import yaml

from kvpilot.operator.api import names
from kvpilot.operator.api.timefmt import parse_time
from kvpilot.operator.router.wake import ApiWaker, WakeError
from tests.k8s.cluster import Cluster
from tests.k8s.test_control_plane import NS, isvc
from tests.operator.conftest import CHART, OperatorProcess, find_tool, wait_for

RELEASE, RELEASE_NS = "kv", "kvpilot-system"
SA_USER = f"system:serviceaccount:{RELEASE_NS}:{RELEASE}-kvpilot"
RBAC_KINDS = {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding"}


def chart_rbac() -> list[dict]:
    """The chart's rendered ServiceAccount, roles and bindings (its test hooks left out)."""
    rendered = subprocess.run(
        [find_tool("helm"), "template", RELEASE, str(CHART), "-n", RELEASE_NS],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [
        doc
        for doc in yaml.safe_load_all(rendered)
        if doc
        and doc["kind"] in RBAC_KINDS
        and "helm.sh/hook" not in (doc["metadata"].get("annotations") or {})
    ]


@pytest.fixture(scope="module")
def rbac(cluster: Cluster) -> list[dict]:
    cluster.install_crd(RELEASE_NS, NS)
    docs = chart_rbac()
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))
    return docs


@pytest.fixture(scope="module")
def operator(cluster: Cluster, rbac: list[dict], tmp_path_factory: pytest.TempPathFactory):
    token = cluster.kubectl(
        "create", "token", f"{RELEASE}-kvpilot", "-n", RELEASE_NS, "--duration=2h"
    ).stdout.strip()
    # The chart's scope (every namespace) and a fast resync; no liveness or metrics ports here.
    proc = OperatorProcess(
        cluster.identity(token),
        tmp_path_factory.mktemp("operator"),
        [],
        ["--all-namespaces", "--resync-interval", "1"],
    )
    yield proc
    proc.stop()
    print(f"\n--- operator log tail ---\n{proc.log[-4000:]}")


def get(cluster: Cluster, *what: str) -> dict:
    return json.loads(cluster.kubectl("get", "-n", NS, *what, "-o", "json", "--show-managed-fields").stdout)


def ready(cluster: Cluster, name: str) -> dict | None:
    status = get(cluster, f"inferenceservice/{name}").get("status") or {}
    return next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), None)


def test_the_chart_role_is_enough_and_nothing_is_refused(cluster: Cluster, operator: OperatorProcess):
    cluster.kubectl("apply", "-f", "-", input=json.dumps(isvc("granted")))
    cluster.wait_exists(NS, "deployment/granted")
    for kind in ("service", "poddisruptionbudget"):
        cluster.kubectl("get", "-n", NS, f"{kind}/granted")
    wait_for(
        lambda: (get(cluster, "inferenceservice/granted").get("status") or {}).get("observedGeneration"), 60
    )
    events = get(cluster, "events", "--field-selector", "involvedObject.name=granted")["items"]
    assert any(
        e["reason"] == "Created" and e["source"].get("component", e.get("reportingComponent")) for e in events
    )
    assert cluster.audit(SA_USER), "the operator made no request under its ServiceAccount"
    refused = [
        (e["verb"], e["objectRef"])
        for e in cluster.audit(SA_USER)
        if e.get("responseStatus", {}).get("code") == 403
    ]
    assert refused == [], refused


def test_a_missing_verb_is_named_in_the_log_and_a_condition(
    cluster: Cluster, operator: OperatorProcess, rbac: list[dict]
):
    role = copy.deepcopy(
        next(d for d in rbac if d["kind"] == "ClusterRole" and d["metadata"]["name"] == f"{RELEASE}-kvpilot")
    )
    for rule in role["rules"]:
        if "deployments" in rule["resources"]:
            rule["verbs"] = [v for v in rule["verbs"] if v != "patch"]
    cluster.kubectl("apply", "-f", "-", input=json.dumps(role))
    try:
        cluster.kubectl("apply", "-f", "-", input=json.dumps(isvc("refused")))
        condition = wait_for(
            lambda: (c := ready(cluster, "refused")) and c["reason"] == "Forbidden" and c,
            60,
            "Ready=False Forbidden",
        )
        assert condition["status"] == "False"
        assert "Deployment refused" in condition["message"] and "patch" in condition["message"], condition
        wait_for(lambda: "RBAC: cannot apply Deployment refused" in operator.log, 30, "the log line")
        assert get(cluster, "inferenceservice/refused")["status"]["phase"] == "Failed"
    finally:
        original = next(
            d for d in rbac if d["kind"] == "ClusterRole" and d["metadata"]["name"] == f"{RELEASE}-kvpilot"
        )
        cluster.kubectl("apply", "-f", "-", input=json.dumps(original))
    # The verb given back, the next pass creates the Deployment and clears the condition.
    wait_for(
        lambda: (c := ready(cluster, "refused")) and c["reason"] != "Forbidden", 60, "the condition cleared"
    )
    cluster.kubectl("get", "-n", NS, "deployment/refused")
    assert names.FIELD_MANAGER in json.dumps(get(cluster, "deployment/refused")["metadata"]["managedFields"])


def test_the_router_may_wake_its_service_and_nothing_else(
    cluster: Cluster, operator: OperatorProcess, tmp_path
):
    """spec.router.frontDoor with limits.minReplicas 0: the operator, under the chart's RBAC, grants the
    router's ServiceAccount get and patch on its own InferenceService (RBAC lets it grant no more than
    it holds); a token of that account stamps wake-requested-at there and is refused on a neighbour.
    Without scale to zero the grant goes and the router pod mounts no token."""
    sleepy = isvc("sleepy")
    sleepy["spec"]["router"] = {"frontDoor": {}}
    sleepy["spec"]["remediation"] = {"limits": {"minReplicas": 0}}
    for body in (sleepy, isvc("neighbour")):
        cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
    router = cluster.wait_exists(NS, "deployment/sleepy-router")
    pod = router["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[args.index("--wake") + 1] == f"{NS}/sleepy", args
    assert (pod["serviceAccountName"], pod["automountServiceAccountToken"]) == ("sleepy-router", True)
    role = cluster.wait_exists(NS, "role/sleepy-router")
    assert role["rules"] == [
        {
            "apiGroups": [names.GROUP],
            "resources": [names.PLURAL],
            "resourceNames": ["sleepy"],
            "verbs": ["get", "patch"],
        }
    ]
    cluster.wait_exists(NS, "rolebinding/sleepy-router")
    token = cluster.kubectl("create", "token", "sleepy-router", "-n", NS, "--duration=1h").stdout.strip()
    (tmp_path / "token").write_text(token)

    def wake(name: str) -> None:
        waker = ApiWaker(
            f"{NS}/{name}", server=cluster.server, token_file=tmp_path / "token", ca_file=cluster.ca
        )
        asyncio.run(waker())

    wake("sleepy")
    stamp = get(cluster, "inferenceservice/sleepy")["metadata"]["annotations"][names.ANNOTATION_WAKE]
    assert abs(parse_time(stamp) - time.time()) < 120, stamp
    with pytest.raises(WakeError, match="403"):
        wake("neighbour")
    assert names.ANNOTATION_WAKE not in (
        get(cluster, "inferenceservice/neighbour")["metadata"].get("annotations") or {}
    )
    granting = [
        e for e in cluster.audit(SA_USER) if (e.get("objectRef") or {}).get("name") == "sleepy-router"
    ]
    assert {e["objectRef"]["resource"] for e in granting} >= {"serviceaccounts", "roles", "rolebindings"}
    refused = [e["objectRef"] for e in granting if e.get("responseStatus", {}).get("code") == 403]
    assert refused == [], refused

    # Scale to zero no longer allowed: the grant goes, the router keeps no token.
    patch = {"spec": {"remediation": {"limits": {"minReplicas": 1}}}}
    cluster.kubectl("patch", "-n", NS, f"{names.PLURAL}/sleepy", "--type=merge", "-p", json.dumps(patch))
    wait_for(lambda: cluster.get(NS, "role/sleepy-router") is None, 60, "the Role deleted")
    for what in ("rolebinding/sleepy-router", "serviceaccount/sleepy-router"):
        wait_for(lambda what=what: cluster.get(NS, what) is None, 60, f"{what} deleted")
    pod = cluster.get(NS, "deployment/sleepy-router")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and "--wake" not in pod["containers"][0]["args"]
