"""The Helm chart: lint, render, every object valid for Kubernetes, secure defaults, values schema."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvpilot.operator.api.platform import DEFAULT_VLLM_IMAGE
from tests.operator.conftest import CHART, K8S_VERSION, find_tool

# Every optional value of the chart turned on (the values other tests render with).
EVERYTHING_ON = Path(__file__).with_name("chart_values_everything.yaml")

VARIANTS = {
    "cluster-wide": [],
    "namespaced": ["--set", "operator.watchNamespaces={llm,batch}", "--set", "rbac.serviceMonitors=true"],
    "custom": ["--set", "serviceAccount.create=false", "--set", "serviceAccount.name=ops", "--set",
               "operator.logFormat=plain", "--set", "operator.verbose=true", "--set", "rbac.create=false"],
    "everything-on": ["-f", str(EVERYTHING_ON)],
    "everything-on-namespaced": ["-f", str(EVERYTHING_ON), "--set", "operator.watchNamespaces={llm,batch}"],
}  # fmt: skip


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([find_tool("helm"), *args], capture_output=True, text=True, timeout=120)


def render(*extra: str) -> list[dict]:
    # Hook objects (helm test) are left out here: test_chart_hooks checks them.
    flags = ("--namespace", "kvpilot-system", "--include-crds", "--skip-tests")
    result = helm("template", "kvp", str(CHART), *flags, *extra)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


@pytest.mark.parametrize("variant", ["default", "everything-on", "everything-on-namespaced"])
def test_lint_strict(variant):
    extra = [] if variant == "default" else VARIANTS[variant]
    result = helm("lint", "--strict", str(CHART), *extra)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rendered_objects_are_valid_kubernetes(variant):
    objects = render(*VARIANTS[variant])
    assert [o["kind"] for o in objects].count("CustomResourceDefinition") == 1
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)  # raises ValidationError


def by_kind(objects: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for obj in objects:
        out.setdefault(obj["kind"], []).append(obj)
    return out


def test_operator_deployment_is_locked_down():
    (deployment,) = by_kind(render())["Deployment"]
    spec = deployment["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    assert container["args"][:2] == ["operator", "--all-namespaces"]
    assert "--liveness=http://0.0.0.0:8080/healthz" in container["args"]
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert container["image"] == "ghcr.io/kvpilot/operator:0.1.0"


def test_scope_selects_cluster_role_or_namespaced_roles():
    cluster = by_kind(render())
    assert {"ClusterRole", "ClusterRoleBinding"} <= set(cluster) and "Role" not in cluster
    namespaced = by_kind(render(*VARIANTS["namespaced"]))
    # Only the tenants' aggregated roles are cluster-wide (aggregation works on ClusterRoles only).
    assert "ClusterRoleBinding" not in namespaced
    assert all(r["metadata"]["name"].endswith(("-view", "-edit")) for r in namespaced["ClusterRole"])
    assert sorted(r["metadata"]["namespace"] for r in namespaced["Role"]) == ["batch", "llm"]
    assert sorted(b["metadata"]["namespace"] for b in namespaced["RoleBinding"]) == ["batch", "llm"]
    (deployment,) = namespaced["Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--namespace=llm" in args and "--namespace=batch" in args and "--all-namespaces" not in args
    assert "--service-monitors" in args
    monitor_rules = [r for r in namespaced["Role"][0]["rules"] if "monitoring.coreos.com" in r["apiGroups"]]
    assert monitor_rules == [
        {
            "apiGroups": ["monitoring.coreos.com"],
            "resources": ["servicemonitors"],
            "verbs": ["get", "create", "patch", "delete"],
        }
    ]
    custom = by_kind(render(*VARIANTS["custom"]))
    assert "ServiceAccount" not in custom and "ClusterRole" not in custom and "Role" not in custom
    assert custom["Deployment"][0]["spec"]["template"]["spec"]["serviceAccountName"] == "ops"


def test_rules_never_grant_wildcards_or_list_secrets():
    everything = by_kind(render(*VARIANTS["everything-on"]))
    roles = everything["ClusterRole"] + everything["Role"]
    assert len(roles) >= 4  # the operator's, the two aggregated tenant roles, leader election's
    for role in roles:
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
            if "secrets" in rule["resources"]:
                # Only the operator, only get: it reads the API key a spec names (spec.apiKeySecretRef)
                # to call the engines' /admin/config; it can never list or watch every Secret.
                assert rule["resources"] == ["secrets"] and rule["verbs"] == ["get"]
                assert role["metadata"]["name"] == "kvp-kvpilot" or role["kind"] == "Role", role["metadata"]
    # Only tenants delete InferenceServices; by default the operator deletes only the children of
    # spec.router and spec.autoscaling it controls, once their field is removed (everything else goes
    # with its InferenceService by garbage collection).
    (operator_role,) = [r for r in by_kind(render())["ClusterRole"] if r["metadata"]["name"] == "kvp-kvpilot"]
    deleting = [rule for rule in operator_role["rules"] if "delete" in rule["verbs"]]
    assert {resource for rule in deleting for resource in rule["resources"]} == {
        "deployments", "services", "inferencepools", "httproutes", "horizontalpodautoscalers",
        "scaledobjects", "serviceaccounts", "roles", "rolebindings",
    }  # fmt: skip
    # RBAC objects only for the router's wake right: no ClusterRoles, no bindings to ClusterRoles.
    rbac = [rule for rule in operator_role["rules"] if "rbac.authorization.k8s.io" in rule["apiGroups"]]
    assert rbac == [
        {
            "apiGroups": ["rbac.authorization.k8s.io"],
            "resources": ["roles", "rolebindings"],
            "verbs": ["get", "create", "patch", "delete"],
        }
    ]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"operator": {"logFormat": "xml"}}, "is not one of"),
        ({"operator": {"watchNamespaces": ["Bad_NS"]}}, "does not match"),
        ({"operator": {"resyncInterval": 0}}, "less than or equal to the minimum"),
        ({"operatr": {}}, "Additional properties are not allowed"),
    ],
)
def test_values_schema_rejects_bad_values(tmp_path, values, message):
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator(schema).validate(defaults)
    merged = {**defaults, **values}
    if "operator" in values:
        merged["operator"] = {**defaults["operator"], **values["operator"]}
    errors = [e.message for e in jsonschema.Draft7Validator(schema).iter_errors(merged)]
    assert any(message in e for e in errors), errors
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    result = helm("template", "kvp", str(CHART), "-f", str(path))
    assert result.returncode != 0 and "values don't meet the specifications of the schema" in result.stderr


def test_every_value_is_documented():
    """Each leaf key in values.yaml has a ``# --`` comment block right above it (helm-docs style)."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    block_indent = None  # inside a documented value that is itself a mapping (e.g. resources)
    for index, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z][\w]*):(.*)$", line)
        if not match:
            continue
        indent, key, rest = len(match.group(1)), match.group(2), match.group(3).strip()
        if block_indent is not None and indent > block_indent:
            continue
        block_indent = None
        following = next((x for x in lines[index + 1 :] if x.strip()), "")
        is_group = rest == "" and len(following) - len(following.lstrip()) > indent
        above = index - 1
        while (
            above >= 0
            and lines[above].lstrip().startswith("#")
            and not lines[above].lstrip().startswith("# --")
        ):
            above -= 1
        documented = above >= 0 and lines[above].lstrip().startswith("# --")
        if is_group and not documented:
            continue  # a plain group of documented keys
        if is_group:
            block_indent = indent
        if not documented:
            undocumented.append(key)
    assert undocumented == []


def test_engine_default_image_and_allowlists_reach_the_operator():
    def env_of(*extra: str) -> dict[str, str]:
        (deployment,) = by_kind(render(*extra))["Deployment"]
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        return {item["name"]: item["value"] for item in container.get("env") or []}

    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    # The chart's vLLM default is the operator's own (the release the runtime is tested against).
    # spec.router.frontDoor pods run `kvpilot router` from the operator's own image.
    assert env_of() == {
        "KVPILOT_DEFAULT_IMAGE": f"ghcr.io/kvpilot/engine:{chart['appVersion']}",
        "KVPILOT_DEFAULT_VLLM_IMAGE": DEFAULT_VLLM_IMAGE,
        "KVPILOT_ROUTER_IMAGE": f"ghcr.io/kvpilot/operator:{chart['appVersion']}",
    }
    custom = env_of(
        "--set", "engine.image.repository=mirror.corp/kvpilot/engine",
        "--set-string", "engine.image.tag=7",
        "--set", "engine.vllmImage.repository=mirror.corp/vllm/vllm-openai",
        "--set", "engine.allowedRegistries={mirror.corp,nvcr.io}",
        "--set", "engine.allowedServiceAccounts={llm}",
    )  # fmt: skip
    assert custom == {
        "KVPILOT_DEFAULT_IMAGE": "mirror.corp/kvpilot/engine:7",
        "KVPILOT_DEFAULT_VLLM_IMAGE": "mirror.corp/" + DEFAULT_VLLM_IMAGE,
        "KVPILOT_ALLOWED_REGISTRIES": "mirror.corp,nvcr.io",
        "KVPILOT_ALLOWED_SERVICE_ACCOUNTS": "llm",
        "KVPILOT_ROUTER_IMAGE": f"ghcr.io/kvpilot/operator:{chart['appVersion']}",
    }
