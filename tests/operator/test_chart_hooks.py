"""`helm test`: the hook renders valid, least-privilege objects, and its check runs against the local
API server: it passes on a healthy install and names what is wrong otherwise."""

from __future__ import annotations

import http.server
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import kubernetes_validate
import pytest
import yaml

from tests.operator.conftest import CHART, CRD_PATH, K8S_VERSION
from tests.operator.kmock_apiserver import ApiServerThread
from tests.operator.test_chart import by_kind, helm

NS = "kvpilot-system"
CRD_PATH_API = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
HOOK = "templates/tests/pod-test-install.yaml"


def render_hook(*extra: str) -> list[dict]:
    result = helm("template", "kvp", str(CHART), "--namespace", NS, "--show-only", HOOK, *extra)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


@pytest.mark.parametrize(
    "extra", [(), ("--set", "networkPolicy.enabled=true"), ("--set", "rbac.create=false")]
)
def test_hook_objects_are_valid_and_least_privilege(extra):
    objects = render_hook(*extra)
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)  # raises ValidationError
        assert obj["metadata"]["annotations"]["helm.sh/hook"] == "test"
    kinds = by_kind(objects)
    (pod,) = kinds["Pod"]
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    if "rbac.create=false" in extra:
        assert set(kinds) == {"Pod"}
        return
    rules = {r["metadata"]["name"]: r["rules"] for r in kinds["ClusterRole"]}
    assert rules == {
        "kvp-kvpilot-test": [
            {
                "apiGroups": ["apiextensions.k8s.io"],
                "resources": ["customresourcedefinitions"],
                "resourceNames": ["inferenceservices.serving.kvpilot.io"],
                "verbs": ["get"],
            }
        ],
        "kvp-kvpilot-test-pods": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}],
    }
    # Pods are listable in the release namespace only: that role is bound there, not cluster-wide.
    (binding,) = kinds["RoleBinding"]
    assert binding["metadata"]["namespace"] == NS and binding["roleRef"]["name"] == "kvp-kvpilot-test-pods"
    assert [b["roleRef"]["name"] for b in kinds["ClusterRoleBinding"]] == ["kvp-kvpilot-test"]
    assert "Role" not in kinds


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (the stdlib's name)
        self.send_response(200 if self.path == "/healthz" else 404)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


@pytest.fixture
def api() -> Iterator[ApiServerThread]:
    """A fresh local API server per test (each installs its own CRD and operator pod)."""
    with ApiServerThread(CRD_PATH) as server:
        yield server


@pytest.fixture
def health_server() -> Iterator[http.server.HTTPServer]:
    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def install(api, chart_crd: dict, pod_labels: dict, *, established: bool = True) -> None:
    """What a cluster holds after `helm install`: the CRD (established) and a running operator pod."""
    api.create(CRD_PATH_API, chart_crd)
    status = {"conditions": [{"type": "Established", "status": "True" if established else "False"}]}
    api.merge_patch(f"{CRD_PATH_API}/{chart_crd['metadata']['name']}/status", {"status": status})
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "kvp-kvpilot-0", "namespace": NS, "labels": pod_labels},
        "spec": {"containers": [{"name": "operator", "image": "operator"}]},
    }
    api.create(f"/api/v1/namespaces/{NS}/pods", pod)
    api.merge_patch(
        f"/api/v1/namespaces/{NS}/pods/kvp-kvpilot-0/status",
        {"status": {"phase": "Running", "podIP": "127.0.0.1"}},
    )


def run_check(api, port: int) -> subprocess.CompletedProcess:
    """The hook's container command, run here against the local API server."""
    objects = render_hook("--set", f"operator.livenessPort={port}")
    (pod,) = by_kind(objects)["Pod"]
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["python", "-c"]
    env = {e["name"]: e["value"] for e in container["env"]}
    env["KVPILOT_TEST_API"] = api.url
    return subprocess.run(
        [sys.executable, "-c", container["args"][0]], env=env, capture_output=True, text=True, timeout=60
    )


def chart_objects(*extra: str) -> dict[str, list[dict]]:
    result = helm("template", "kvp", str(CHART), "--namespace", NS, "--skip-tests", *extra)
    assert result.returncode == 0, result.stderr
    return by_kind([d for d in yaml.safe_load_all(result.stdout) if d])


def test_helm_test_passes_on_a_healthy_install(api, health_server):
    port = health_server.server_address[1]
    objects = chart_objects("--set", f"operator.livenessPort={port}")
    (crd,) = objects["CustomResourceDefinition"]
    pod_labels = objects["Deployment"][0]["spec"]["template"]["metadata"]["labels"]
    install(api, crd, pod_labels)
    result = run_check(api, port)
    assert result.returncode == 0, result.stdout + result.stderr
    columns = len(crd["spec"]["versions"][0]["additionalPrinterColumns"])
    assert (
        f"ok: CRD inferenceservices.serving.kvpilot.io serves v1alpha1 with {columns} columns"
        in result.stdout
    )


def test_helm_test_fails_when_the_operator_does_not_answer(api):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here once the socket closes
    objects = chart_objects()
    install(
        api,
        objects["CustomResourceDefinition"][0],
        objects["Deployment"][0]["spec"]["template"]["metadata"]["labels"],
    )
    result = run_check(api, port)
    assert result.returncode == 1
    assert (
        f"FAIL operator pod kvp-kvpilot-0: http://127.0.0.1:{port}/healthz does not answer" in result.stdout
    )


def test_helm_test_fails_on_a_stale_crd_and_without_operator_pods(api, health_server):
    """An upgrade that left the old schema behind (a column missing), not established, no operator."""
    objects = chart_objects()
    stale = json.loads(json.dumps(objects["CustomResourceDefinition"][0]))
    stale["spec"]["versions"][0]["additionalPrinterColumns"].pop(1)
    install(api, stale, {"app.kubernetes.io/name": "something-else"}, established=False)
    result = run_check(api, health_server.server_address[1])
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert "FAIL CRD inferenceservices.serving.kvpilot.io is not Established" in lines
    assert any(
        line.startswith("FAIL CRD inferenceservices.serving.kvpilot.io: printer columns") for line in lines
    )
    assert any(line.startswith(f"FAIL no running operator pod in {NS}") for line in lines)
