"""Platform fit of the chart: tenant roles aggregated into the built-in ones, the operator pod's
escape hatches (extra args, env, volumes, labels, spread, security contexts)."""

from __future__ import annotations

import pytest

from kvpilot.operator.api import names
from tests.operator.conftest import CHART
from tests.operator.test_chart import VARIANTS, by_kind, helm, render

# The labels Kubernetes' built-in user-facing ClusterRoles aggregate by (their aggregationRule
# clusterRoleSelectors in the RBAC bootstrap policy, plugin/pkg/auth/authorizer/rbac/bootstrappolicy).
AGGREGATE_TO = {role: f"rbac.authorization.k8s.io/aggregate-to-{role}" for role in ("admin", "edit", "view")}
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}
READ_VERBS = {"get", "list", "watch"}


def grants(role: dict) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def aggregated_to(roles: list[dict], builtin: str) -> set[tuple[str, str, str]]:
    """What the built-in role ``builtin`` gains from ``roles``, aggregation chained as Kubernetes
    chains it (view's rules are part of edit, edit's part of admin)."""
    chain = {"view": ["view"], "edit": ["view", "edit"], "admin": ["view", "edit", "admin"]}[builtin]
    out: set[tuple[str, str, str]] = set()
    for role in roles:
        labels = role["metadata"].get("labels") or {}
        if any(labels.get(AGGREGATE_TO[r]) == "true" for r in chain):
            out |= grants(role)
    return out


@pytest.mark.parametrize("variant", ["cluster-wide", "namespaced"])
def test_tenant_roles_aggregate_into_view_edit_and_admin(variant):
    roles = [r for r in by_kind(render(*VARIANTS[variant]))["ClusterRole"] if "aggregationRule" not in r]
    isvc = names.PLURAL
    view = aggregated_to(roles, "view")
    assert view == {
        (names.GROUP, res, verb) for res in (isvc, f"{isvc}/status", f"{isvc}/scale") for verb in READ_VERBS
    }
    edit = aggregated_to(roles, "edit")
    assert {(names.GROUP, isvc, verb) for verb in WRITE_VERBS | READ_VERBS} <= edit
    assert {(names.GROUP, f"{isvc}/scale", verb) for verb in ("update", "patch")} <= edit
    # Tenants never write the status (the operator owns it) and get nothing outside the group.
    assert not any(res == f"{isvc}/status" and verb in WRITE_VERBS for _, res, verb in edit)
    assert {group for group, _, _ in edit} == {names.GROUP}
    assert aggregated_to(roles, "admin") == edit
    # The operator's own role is bound to its ServiceAccount only, never aggregated.
    for role in roles:
        if not role["metadata"]["name"].endswith(("-view", "-edit")):
            assert not any(key in role["metadata"]["labels"] for key in AGGREGATE_TO.values())


def test_aggregation_can_be_turned_off():
    roles = by_kind(render("--set", "rbac.aggregateToDefaultRoles=false"))["ClusterRole"]
    assert [r["metadata"]["name"] for r in roles] == ["kvp-kvpilot"]


def operator_pod(*extra: str) -> dict:
    (deployment,) = by_kind(render(*extra))["Deployment"]
    return deployment["spec"]["template"]


def test_escape_hatches_reach_the_operator_pod():
    template = operator_pod(*VARIANTS["everything-on"])
    pod = template["spec"]
    (container,) = pod["containers"]
    assert container["args"][-1] == "--priority=10"
    env = {e["name"]: e for e in container["env"]}
    assert env["TZ"] == {"name": "TZ", "value": "UTC"}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert "KVPILOT_DEFAULT_IMAGE" in env  # the chart's own stay
    assert {"name": "ca", "configMap": {"name": "corporate-ca"}} in pod["volumes"]
    assert {"name": "tmp", "emptyDir": {}} in pod["volumes"]
    assert {"name": "ca", "mountPath": "/etc/ssl/corporate", "readOnly": True} in container["volumeMounts"]
    assert pod["topologySpreadConstraints"][0]["topologyKey"] == "kubernetes.io/hostname"
    assert template["metadata"]["labels"]["example.com/tier"] == "control"
    assert template["metadata"]["annotations"] == {"example.com/owner": "ml-platform"}
    # commonLabels go on every object, never on selectors (they would break upgrades).
    objects = render(*VARIANTS["everything-on"])
    assert all(o["metadata"]["labels"]["team"] == "ml-platform" for o in objects)
    (deployment,) = by_kind(objects)["Deployment"]
    assert "team" not in deployment["spec"]["selector"]["matchLabels"]


def test_security_contexts_can_be_overridden_for_openshift():
    default = operator_pod()["spec"]
    assert default["securityContext"]["runAsUser"] == 65532
    openshift = operator_pod(
        "--set", "operator.podSecurityContext.runAsUser=null",
        "--set", "operator.podSecurityContext.runAsGroup=null",
    )["spec"]  # fmt: skip
    assert openshift["securityContext"] == {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert openshift["containers"][0]["securityContext"] == default["containers"][0]["securityContext"]
    hardened = operator_pod("--set", "operator.securityContext.runAsUser=1001")["spec"]["containers"][0]
    assert hardened["securityContext"]["runAsUser"] == 1001
    assert hardened["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_operator_readiness_probe_reads_healthz():
    (container,) = operator_pod()["spec"]["containers"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}


@pytest.mark.parametrize(
    "values",
    [
        ["--set", "operator.extraArgs={positional}"],
        [
            "--set",
            "operator.extraVolumes[0].name=tmp",
            "--set",
            "operator.extraVolumes[0].emptyDir.medium=Memory",
        ],
        [
            "--set",
            "operator.extraVolumeMounts[0].name=x",
            "--set",
            "operator.extraVolumeMounts[0].mountPath=/tmp",
        ],
        ["--set", "operator.topologySpreadConstraints[0].maxSkew=1"],
        ["--set", "commonLabels.team=1", "--set", "commonLabels.bad=true"],
    ],
)
def test_schema_rejects_escape_hatches_that_break_the_pod(values):
    result = helm("template", "kvp", str(CHART), *values)
    assert result.returncode != 0 and "values don't meet the specifications of the schema" in result.stderr


def test_replicas_elect_a_leader_with_the_rbac_and_pdb_it_needs():
    single = by_kind(render())
    (deployment,) = single["Deployment"]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert not any(
        "--leader-elect" in a for a in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    )
    assert "PodDisruptionBudget" not in single and "Role" not in single

    ha = by_kind(render("--set", "operator.replicaCount=3"))
    (deployment,) = ha["Deployment"]
    spec = deployment["spec"]
    assert spec["replicas"] == 3
    assert spec["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    args = spec["template"]["spec"]["containers"][0]["args"]
    assert [a for a in args if a.startswith("--leader-elect")] == [
        "--leader-elect",
        "--leader-elect-namespace=kvpilot-system",
        "--leader-elect-lease=kvp-kvpilot",
        "--leader-elect-lease-duration=15",
        "--leader-elect-renew-deadline=10",
        "--leader-elect-retry-period=2",
    ]
    (pdb,) = ha["PodDisruptionBudget"]
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    (role,) = ha["Role"]
    assert role["metadata"]["namespace"] == "kvpilot-system"
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": ["kvp-kvpilot"],  # the Lease the args name, and no other
            "verbs": ["get", "patch"],
        },
    ]
    (binding,) = [b for b in ha["RoleBinding"] if b["roleRef"]["name"] == role["metadata"]["name"]]
    assert binding["subjects"][0]["name"] == spec["template"]["spec"]["serviceAccountName"]
    # One replica can elect too (clean hand-overs on rolling updates), without a PDB.
    elected_single = by_kind(render("--set", "operator.leaderElection.enabled=true"))
    assert elected_single["Deployment"][0]["spec"]["strategy"]["type"] == "RollingUpdate"
    assert "PodDisruptionBudget" not in elected_single


def test_leader_election_timing_must_let_a_leader_stop_first():
    result = helm(
        "template", "kvp", str(CHART), "--set", "operator.replicaCount=2",
        "--set", "operator.leaderElection.renewDeadline=15",
    )  # fmt: skip
    assert result.returncode != 0
    assert "retryPeriod < renewDeadline < leaseDuration" in result.stderr
