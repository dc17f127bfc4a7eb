"""Rollout and deletion on the real control plane with kwok's simulated nodes (kwok.yaml).

A spec change rolls out through kube-controller-manager's ReplicaSets onto kwok pods, and the
InferenceService's status follows it: the phases the operator wrote are read back from the API
server's audit log (status patches are logged with their bodies). An InferenceService held by
another controller's finalizer shows the path a fake never had: a ``deletionTimestamp`` on a live
object, which the remediation loop and the reconciler must leave alone.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from kvpilot.operator.api import names
from tests.k8s.cluster import OPERATOR_TOKEN, OPERATOR_USER, Cluster
from tests.k8s.test_control_plane import isvc
from tests.operator.conftest import OperatorProcess, wait_for
from tests.operator.test_operator_kmock import free_port

NS = "roll"
HOLD = "example.com/hold"  # another controller's finalizer (a backup tool, a GitOps engine)


@pytest.fixture(scope="module")
def operator(node_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory):
    node_cluster.install_crd(NS)
    node_cluster.provide_volume(NS)  # the claim of the model source (pvc://models/tiny)
    metrics_port = free_port()
    proc = OperatorProcess(
        node_cluster.identity(OPERATOR_TOKEN),
        tmp_path_factory.mktemp("operator"),
        [NS],
        ["--resync-interval", "1", "--scrape-interval", "0.5", "--liveness", "",
         "--metrics-port", str(metrics_port), "--metrics-address", "127.0.0.1"],
    )  # fmt: skip
    proc.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    yield proc
    proc.stop()
    print(f"\n--- operator log tail ---\n{proc.log[-4000:]}")


def service(name: str, replicas: int, **engine) -> dict:
    body = isvc(name)
    body["metadata"]["namespace"] = NS
    body["spec"]["replicas"] = replicas
    body["spec"]["engine"].update(engine)
    return body


def status_writes(cluster: Cluster, name: str) -> list[dict]:
    """The operator's status patches of ``name``, oldest first (their bodies, from the audit log)."""
    events = cluster.audit(
        OPERATOR_USER, resource="inferenceservices", namespace=NS, name=name, subresource="status"
    )
    return [(e.get("requestObject") or {}).get("status") or {} for e in events if e["verb"] == "patch"]


def owned_by(items: list[dict], kind: str, name: str) -> list[dict]:
    return [
        i
        for i in items
        if any(o["kind"] == kind and o["name"] == name for o in i["metadata"].get("ownerReferences") or [])
    ]


def listing(cluster: Cluster, kind: str, selector: str) -> list[dict]:
    return json.loads(cluster.kubectl("get", kind, "-n", NS, "-l", selector, "-o", "json").stdout)["items"]


def settled_on(cluster: Cluster, name: str, generation: int, replicas: int) -> dict | None:
    live = cluster.get(NS, f"inferenceservice/{name}") or {}
    status = live.get("status") or {}
    ready = next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), {})
    done = (
        status.get("observedGeneration") == generation
        and status.get("phase") == "Ready"
        and status.get("readyReplicas") == replicas
        and (status.get("effective") or {}).get("basedOnGeneration") == generation
        and ready.get("status") == "True"
    )
    return live if done else None


def test_a_spec_change_rolls_out_through_replica_sets_and_status_follows(
    node_cluster: Cluster, operator: OperatorProcess
):
    cluster = node_cluster
    cluster.kubectl("apply", "-f", "-", input=json.dumps(service("web", 2, maxNumSeqs=8)))
    first = wait_for(lambda: settled_on(cluster, "web", 1, 2), 90, "generation 1 Ready on kwok pods")
    assert first["status"]["effective"]["maxNumSeqs"] == 8
    (old_rs,) = owned_by(listing(cluster, "replicasets", f"{names.LABEL_ISVC}=web"), "Deployment", "web")
    before = len(status_writes(cluster, "web"))

    cluster.kubectl(
        "patch",
        "-n",
        NS,
        "inferenceservice/web",
        "--type=merge",
        "-p",
        '{"spec":{"engine":{"maxNumSeqs":16}}}',
    )
    live = wait_for(lambda: settled_on(cluster, "web", 2, 2), 90, "generation 2 rolled out")
    assert live["status"]["effective"]["maxNumSeqs"] == 16

    # kube-controller-manager made a second ReplicaSet, scaled it up and the first one down.
    sets = owned_by(listing(cluster, "replicasets", f"{names.LABEL_ISVC}=web"), "Deployment", "web")
    by_name = {rs["metadata"]["name"]: rs for rs in sets}
    assert len(sets) == 2 and old_rs["metadata"]["name"] in by_name, list(by_name)
    assert by_name.pop(old_rs["metadata"]["name"])["spec"]["replicas"] == 0
    (new_rs,) = by_name.values()
    assert new_rs["spec"]["replicas"] == 2 and new_rs["status"].get("readyReplicas") == 2
    # Every pod left runs the new configuration (kwok made them Ready; none of the old remain).
    pods = wait_for(
        lambda: (p := listing(cluster, "pods", f"{names.LABEL_ISVC}=web")) and len(p) == 2 and p,
        60,
        "old pods gone",
    )
    hashes = {p["metadata"]["labels"][names.LABEL_TEMPLATE_HASH] for p in pods}
    assert hashes == {new_rs["metadata"]["labels"][names.LABEL_TEMPLATE_HASH]}, hashes
    for pod in pods:
        (engine,) = [c for c in pod["spec"]["containers"] if c["name"] == names.ENGINE_CONTAINER]
        assert engine["args"][engine["args"].index("--max-num-seqs") + 1] == "16"
        assert pod["spec"]["nodeName"] == "kwok-0" and pod["status"]["podIP"].startswith("127.1.")

    # What the operator wrote meanwhile, in order: the new generation Progressing, then Ready.
    phases = [w["phase"] for w in status_writes(cluster, "web")[before:] if "phase" in w]
    assert "Progressing" in phases and phases[-1] == "Ready", phases
    assert phases.index("Progressing") < len(phases) - 1 - phases[::-1].index("Ready"), phases


def operator_series(operator: OperatorProcess, name: str) -> list[str]:
    with urllib.request.urlopen(operator.metrics_url, timeout=10) as response:  # noqa: S310 - loopback
        text = response.read().decode()
    return [
        line
        for line in text.splitlines()
        if not line.startswith("#") and f'inferenceservice="{name}"' in line
    ]


def pod_lists(cluster: Cluster) -> int:
    """The remediation loop's listings of engine pods so far (one per tick)."""
    return sum(1 for e in cluster.audit(OPERATOR_USER, resource="pods") if e["verb"] == "list")


def test_a_deletion_held_by_a_finalizer_is_left_alone_then_collected(
    node_cluster: Cluster, operator: OperatorProcess
):
    cluster = node_cluster
    held = service("held", 1)
    held["metadata"]["finalizers"] = [HOLD]
    cluster.kubectl("apply", "-f", "-", input=json.dumps(held))
    wait_for(lambda: settled_on(cluster, "held", 1, 1), 90, "held Ready")
    wait_for(lambda: operator_series(operator, "held"), 30, "the operator's series of held")

    cluster.kubectl("delete", "-n", NS, "inferenceservice/held", "--wait=false")
    live = cluster.get(NS, "inferenceservice/held")
    assert live["metadata"].get("deletionTimestamp") and live["metadata"]["finalizers"] == [HOLD]
    # The operator adds no finalizer of its own and makes no write to the object while it waits:
    # over ten remediation ticks (counted as the loop's pod listings in the audit log) not one.
    writes = len(
        [
            e
            for e in cluster.audit(OPERATOR_USER, resource="inferenceservices", name="held")
            if e["verb"] in ("patch", "update")
        ]
    )
    ticks = pod_lists(cluster)
    wait_for(lambda: pod_lists(cluster) >= ticks + 10, 60, "ten remediation ticks")
    after = [
        e
        for e in cluster.audit(OPERATOR_USER, resource="inferenceservices", name="held")
        if e["verb"] in ("patch", "update")
    ]
    assert after[writes:] == [], [(e["verb"], e["objectRef"]) for e in after[writes:]]
    # Its per-service series are gone from the operator's metrics (the loop's deletion branch).
    wait_for(lambda: not operator_series(operator, "held"), 30, "held's series dropped")
    # The children stay until the object is really gone (garbage collection waits for it).
    assert cluster.get(NS, "deployment/held") is not None

    cluster.kubectl(
        "patch", "-n", NS, "inferenceservice/held", "--type=merge", "-p", '{"metadata":{"finalizers":null}}'
    )
    wait_for(lambda: cluster.get(NS, "inferenceservice/held") is None, 30, "held deleted")

    def children() -> list[str]:
        items = [
            *listing(
                cluster, "deployments,replicasets,services,poddisruptionbudgets", f"{names.LABEL_ISVC}=held"
            ),
            *listing(cluster, "pods", f"{names.LABEL_ISVC}=held"),
        ]
        return [f"{i['kind']}/{i['metadata']['name']}" for i in items]

    wait_for(lambda: not children(), 60, "the garbage collector took every child")
    assert operator.proc.poll() is None
