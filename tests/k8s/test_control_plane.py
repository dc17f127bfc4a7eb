"""The CRD, server-side apply beside other field managers, and garbage collection, on a real
kube-apiserver, etcd and kube-controller-manager (tests/k8s/cluster.py).

Writes are counted from the API server's own audit log, not from the operator's account of itself.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from kvpilot.operator.api import names
from tests.k8s.cluster import OPERATOR_TOKEN, OPERATOR_USER, Cluster
from tests.operator.conftest import CHART, CRD_PATH, EXAMPLE, OperatorProcess, find_tool, wait_for

INVALID = sorted((Path(__file__).parents[1] / "operator" / "invalid").glob("*.yaml"))
NS = "llm"
WRITE_VERBS = {"create", "update", "patch", "delete"}


def expectation(path: Path) -> str:
    """``schema`` or ``operator``: who refuses the fixture (its first line says)."""
    return path.read_text().splitlines()[0].split("(", 1)[1].split(")", 1)[0]


@pytest.fixture(scope="module")
def crd_installed(cluster: Cluster) -> Cluster:
    return cluster.install_crd(NS)


def test_the_crd_is_structural_and_its_names_accepted(crd_installed: Cluster):
    crd = json.loads(
        crd_installed.kubectl("get", "crd", "inferenceservices.serving.kvpilot.io", "-o", "json").stdout
    )
    conditions = {c["type"]: c for c in crd["status"]["conditions"]}
    assert conditions["Established"]["status"] == "True"
    assert conditions["NamesAccepted"]["status"] == "True"
    assert "NonStructuralSchema" not in conditions, conditions.get("NonStructuralSchema")


def test_the_chart_installs_its_crd_on_the_api_server(crd_installed: Cluster):
    """The CRD as the chart renders it (its template, labels and annotations) is accepted as well."""
    rendered = subprocess.run(
        [find_tool("helm"), "template", "kv", str(CHART), "-n", "kvpilot-system"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    crds = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "CustomResourceDefinition"]
    assert [d["metadata"]["name"] for d in crds] == ["inferenceservices.serving.kvpilot.io"]
    done = crd_installed.kubectl(
        "apply",
        "--server-side",
        "--force-conflicts",
        "--field-manager=helm",
        "-f",
        "-",
        input=json.dumps(crds[0]),
    )
    assert "serverside-applied" in done.stdout, done.stdout
    crd_installed.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", "crd/inferenceservices.serving.kvpilot.io"
    )


@pytest.mark.parametrize("fixture", INVALID, ids=[p.stem for p in INVALID])
def test_invalid_examples_are_refused_by_the_api_server_naming_the_field(
    crd_installed: Cluster, fixture: Path
):
    done = crd_installed.kubectl("create", "--dry-run=server", "-f", str(fixture), check=False)
    if expectation(fixture) == "operator":
        # Beyond what a schema can say (the operator refuses it with a condition): the API accepts it.
        assert done.returncode == 0, done.stderr
        return
    assert done.returncode != 0, f"{fixture.name} was accepted"
    # Refused by validation (422, the schema and CEL rules) or strict decoding (400, an unknown field),
    # and the message names the field.
    assert "is invalid" in done.stderr or "strict decoding error" in done.stderr, done.stderr
    assert re.search(r"\b(spec|metadata)\.[A-Za-z]", done.stderr), done.stderr


def test_printer_columns_and_the_scale_subresource(crd_installed: Cluster):
    crd_installed.kubectl("apply", "-f", str(EXAMPLE))
    name = yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"]
    header = crd_installed.kubectl("get", "inferenceservices", "-n", NS).stdout.splitlines()[0].split()
    crd = yaml.safe_load(CRD_PATH.read_text())
    columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    assert header == ["NAME", *(c["name"].upper() for c in columns if not c.get("priority"))]
    wide = (
        crd_installed.kubectl("get", "inferenceservices", "-n", NS, "-o", "wide")
        .stdout.splitlines()[0]
        .split()
    )
    assert wide == ["NAME", *(c["name"].upper() for c in columns)]
    crd_installed.kubectl("scale", "-n", NS, f"inferenceservice/{name}", "--replicas=3")
    live = json.loads(crd_installed.kubectl("get", "-n", NS, f"inferenceservice/{name}", "-o", "json").stdout)
    assert live["spec"]["replicas"] == 3
    crd_installed.kubectl("delete", "-n", NS, f"inferenceservice/{name}", "--wait=true")


@pytest.fixture(scope="module")
def operator(crd_installed: Cluster, tmp_path_factory: pytest.TempPathFactory):
    proc = OperatorProcess(
        crd_installed.identity(OPERATOR_TOKEN),
        tmp_path_factory.mktemp("operator"),
        [NS],
        ["--resync-interval", "1", "--liveness", ""],
    )
    yield proc
    proc.stop()
    print(f"\n--- operator log tail ---\n{proc.log[-4000:]}")


def isvc(name: str) -> dict:
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "model": {"source": "pvc://models/tiny"},
            "image": "kvpilot/engine:test",
            "replicas": 1,
            "resources": {"cpu": "1", "memory": "1Gi"},
            "engine": {"maxNumSeqs": 8, "maxModelLen": 256, "maxNumBatchedTokens": 256},
        },
    }


def deployment_writes(cluster: Cluster, name: str) -> list[dict]:
    return [
        e
        for e in cluster.audit(OPERATOR_USER, resource="deployments", namespace=NS, name=name)
        if e["verb"] in WRITE_VERBS and not (e["objectRef"].get("subresource"))
    ]


def passes(cluster: Cluster, name: str) -> int:
    """The operator's reconcile passes over ``name`` so far: each starts with a read of it."""
    return sum(
        1
        for e in cluster.audit(OPERATOR_USER, resource="inferenceservices", namespace=NS, name=name)
        if e["verb"] == "get" and not e["objectRef"].get("subresource")
    )


def wait_passes(cluster: Cluster, name: str, count: int) -> None:
    start = passes(cluster, name)
    wait_for(lambda: passes(cluster, name) >= start + count, timeout=60, what=f"{count} reconcile passes")


NEIGHBOUR = """
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {name}
  namespace: llm
  labels: {{mesh.example.com/injected: "true"}}
spec:
  template:
    spec:
      containers:
      - name: engine
        env: [{{name: INJECTED, value: "1"}}]
      - name: mesh-proxy
        image: mesh/proxy:1.0
"""


def test_other_managers_entries_survive_and_cost_no_writes(cluster: Cluster, operator: OperatorProcess):
    """A webhook or mesh adds an env var, a sidecar and a label: the API server merges them in beside
    the operator's (containers and env are merged by name), and the operator leaves them alone."""
    cluster.kubectl("apply", "-f", "-", input=json.dumps(isvc("neighbours")))
    path = "deployment/neighbours"
    cluster.wait_exists(NS, path)
    cluster.kubectl(
        "apply",
        "--server-side",
        "--field-manager=mesh-injector",
        "-f",
        "-",
        input=NEIGHBOUR.format(name="neighbours"),
    )
    wait_passes(cluster, "neighbours", 2)  # whatever was in flight has finished
    before = len(deployment_writes(cluster, "neighbours"))
    wait_passes(cluster, "neighbours", 10)
    assert deployment_writes(cluster, "neighbours")[before:] == [], (
        "the operator rewrote a settled Deployment"
    )
    live = json.loads(cluster.kubectl("get", "-n", NS, path, "-o", "json").stdout)
    containers = {c["name"]: c for c in live["spec"]["template"]["spec"]["containers"]}
    assert set(containers) == {"engine", "mesh-proxy"}
    assert {"name": "INJECTED", "value": "1"} in containers["engine"]["env"]
    assert live["metadata"]["labels"]["mesh.example.com/injected"] == "true"
    assert operator.proc.poll() is None


def test_an_edit_of_an_owned_field_is_restored_in_one_write(cluster: Cluster, operator: OperatorProcess):
    cluster.kubectl("apply", "-f", "-", input=json.dumps(isvc("edited")))
    path = "deployment/edited"
    cluster.wait_exists(NS, path)
    wait_passes(cluster, "edited", 2)
    before = len(deployment_writes(cluster, "edited"))
    cluster.kubectl("patch", "-n", NS, path, "--type=merge", "-p", '{"spec":{"replicas":7}}')
    wait_for(
        lambda: (
            json.loads(cluster.kubectl("get", "-n", NS, path, "-o", "json").stdout)["spec"]["replicas"] == 1
        ),
        60,
        "replicas restored",
    )
    wait_passes(cluster, "edited", 10)
    writes = deployment_writes(cluster, "edited")[before:]
    assert [w["verb"] for w in writes] == ["patch"], writes


def test_deleting_an_inference_service_collects_its_children(cluster: Cluster, operator: OperatorProcess):
    cluster.kubectl("apply", "-f", "-", input=json.dumps(isvc("doomed")))
    cluster.wait_exists(NS, "deployment/doomed")
    cluster.kubectl("delete", "-n", NS, "inferenceservice/doomed", "--wait=true", "--timeout=60s")

    def children() -> list:
        out = cluster.kubectl("get", "-n", NS, "deployments,services,replicasets,pods", "-o", "json").stdout
        return [
            i["metadata"]["name"]
            for i in json.loads(out)["items"]
            if i["metadata"]["name"].startswith("doomed")
        ]

    deadline = time.monotonic() + 60
    while children() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert children() == [], "the garbage collector left children behind"
