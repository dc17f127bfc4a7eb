"""The closed loop on real objects: real engines for kwok pods, a storm remediated end to end, and an
OOM kill that drives the revert.

The InferenceService is the one ``make demo`` writes (a KV pool calibrated too small for its load),
with remediation Auto and every change rolled out (``liveLevers: false``), its pods placed on the kwok
node ``kwok-engines``. There kwok gives each pod an address 127.0.2.N and ``engine_node.EngineNode``
runs the pod's rendered args as a real ``kvpilot serve`` bound to it. Nothing else is simulated: the
operator scrapes the pod IPs, writes the remediation into status, re-renders the Deployment, and
kube-controller-manager rolls it out through a new ReplicaSet onto a new pod whose engine serves with
the larger pool. Then kwok's OOM stage kills that pod's engine container once (restartCount + 1,
lastState OOMKilled); the operator blames its change and reverts it, and that rolls out too.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.vllm_storm import counter, get
from kvpilot.operator.api import names
from kvpilot.operator.demo.live import Load
from kvpilot.operator.demo.prepare import THRESHOLD, calibrate, ensure_model, write_manifest
from kvpilot.operator.remediation.evaluate import EVENT_APPLIED, EVENT_REVERTED
from kvpilot.operator.remediation.pods import is_ready
from tests.k8s.cluster import ENGINES_NODE, ENGINES_TAINT, OPERATOR_TOKEN, OPERATOR_USER, Cluster
from tests.k8s.engine_node import EngineNode
from tests.operator.conftest import OperatorProcess, wait_for
from tests.operator.local_support import leftovers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
NS = "loop"
RAISE = "raiseGpuMemoryUtilization"


def cache_blocks(url: str) -> int:
    """The engine's KV pool in blocks (the ``num_gpu_blocks`` label of ``vllm:cache_config_info``)."""
    for family in text_string_to_metric_families(get(url + names.METRICS_PATH, timeout=10)):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                return int(sample.labels["num_gpu_blocks"])
    raise AssertionError("no vllm:cache_config_info")


def preemptions(url: str) -> float:
    return counter(get(url + names.METRICS_PATH, timeout=10), "vllm:num_preemptions_total")


def fraction_of(args: list[str]) -> float:
    return float(args[args.index("--gpu-memory-utilization") + 1])


def deployment_fraction(cluster: Cluster) -> float:
    deployment = cluster.get(NS, "deployment/demo")
    (engine,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "engine"]
    return fraction_of(engine["args"])


def serving_pod(cluster: Cluster, node: EngineNode, fraction: float) -> dict | None:
    """The one engine pod left, Ready, running ``fraction`` (the rollout is over), or None."""
    pods = json.loads(cluster.kubectl("get", "pods", "-n", NS, "-o", "json").stdout)["items"]
    if len(pods) != 1:
        return None
    (pod,) = pods
    replica = node.replicas.get(pod["metadata"]["uid"])
    if is_ready(pod) and replica is not None and fraction_of(replica.args) == fraction:
        return pod
    return None


def remediations(cluster: Cluster) -> list[dict]:
    return ((cluster.get(NS, "inferenceservice/demo") or {}).get("status") or {}).get("remediations") or []


class LoadThread:
    """The demo's load (8 streaming clients) on an event loop of its own; ``url`` can be re-pointed."""

    def __init__(self, url: str, model_name: str, vocab: int, max_tokens: int) -> None:
        self.load = Load(url, model_name, vocab, max_tokens)
        self.thread = threading.Thread(target=asyncio.run, args=(self.load.run(),), daemon=True)

    def point(self, url: str) -> None:
        self.load.url = url  # read by each client before its next request

    def __enter__(self) -> LoadThread:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.load.stopping.set()  # each client ends after its request in flight
        self.thread.join(timeout=120)


def test_a_storm_on_kwok_pods_is_remediated_and_an_oom_kill_reverts_it(
    node_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory
):
    cluster = node_cluster
    out = tmp_path_factory.mktemp("loop")
    model = ensure_model(None, out, "test")
    vocab = min(int(json.loads((model / "config.json").read_text()).get("vocab_size", 1000)), 1000)
    cal = calibrate(model, out)
    isvc = write_manifest(out / "inferenceservice.yaml", model, cal, window_s=6, cooldown_s=10, live=False)
    isvc["metadata"]["namespace"] = NS
    isvc["spec"]["pod"] = {
        "nodeSelector": {"kubernetes.io/hostname": ENGINES_NODE},
        "tolerations": [{**ENGINES_TAINT, "operator": "Equal"}],
    }
    start = cal["fraction"]
    cluster.install_crd(NS)
    node = EngineNode(cluster, model, out / "engines").start()
    operator = OperatorProcess(
        cluster.identity(OPERATOR_TOKEN),
        out,
        [NS],
        ["--resync-interval", "2", "--scrape-interval", "1", "--liveness", ""],
    )
    pids: list[int] = []
    try:
        cluster.kubectl("apply", "-f", "-", input=json.dumps(isvc))
        first = wait_for(lambda: serving_pod(cluster, node, start), 180, "the first engine pod serving")
        first_url = f"http://{first['status']['podIP']}:{names.HTTP_PORT}"
        assert first["status"]["podIP"].startswith("127.0.2."), first["status"]["podIP"]

        # 1. The storm, remediated by a rollout.
        with LoadThread(first_url, isvc["spec"]["model"]["name"], vocab, cal["max_tokens"]) as load:
            change = wait_for(
                lambda: next((r for r in remediations(cluster) if r.get("lever") == RAISE), None),
                240,
                "the operator raising gpuMemoryUtilization",
            )
            storm_preemptions = preemptions(first_url)
            blocks_before = cache_blocks(first_url)
            raised = float(change["to"])
            assert raised > start and float(change["from"]) == start, change
            wait_for(lambda: deployment_fraction(cluster) == raised, 30, "the Deployment re-rendered")
            second = wait_for(lambda: serving_pod(cluster, node, raised), 240, "the raised pool rolled out")
            second_url = f"http://{second['status']['podIP']}:{names.HTTP_PORT}"
            assert second["metadata"]["name"] != first["metadata"]["name"]
            load.point(second_url)
            moved = time.time()
            time.sleep(4)  # the clients have moved to the new pod
            began, before = time.monotonic(), preemptions(second_url)
            time.sleep(12)
            calm_rate = (preemptions(second_url) - before) / (time.monotonic() - began)
            blocks_after = cache_blocks(second_url)
        completed_on_second = len([t for t in load.load.trips if t.start >= moved])
        pids = node.pids()
        print(
            f"\nstorm: {storm_preemptions:g} preemptions on {first['metadata']['name']} "
            f"({blocks_before} KV blocks, gpuMemoryUtilization {start:g}); after the rollout: "
            f"{calm_rate:.2f}/s on {second['metadata']['name']} ({blocks_after} blocks, {raised:g}), "
            f"{completed_on_second} requests completed there"
        )
        assert storm_preemptions >= 5, storm_preemptions  # a storm by the engine's own count
        assert blocks_after > blocks_before, (blocks_before, blocks_after)
        assert calm_rate < THRESHOLD, calm_rate
        assert completed_on_second > 0

        # 2. kwok OOM-kills the new pod's engine container: the operator blames its change and reverts.
        cluster.kubectl(
            "label", "pod", "-n", NS, second["metadata"]["name"], "kvpilot.dev/kwok-fault=oom-killed"
        )
        revert = wait_for(
            lambda: next((r for r in remediations(cluster) if r.get("lever") == "revert"), None),
            120,
            "the revert",
        )
        assert "OOMKilled" in revert["reason"] and RAISE in revert["reason"], revert
        assert float(revert["to"]) == start, revert
        wait_for(lambda: deployment_fraction(cluster) == start, 30, "the Deployment re-rendered back")
        third = wait_for(lambda: serving_pod(cluster, node, start), 240, "the revert rolled out")
        assert third["metadata"]["name"] != second["metadata"]["name"]
        events = json.loads(
            cluster.kubectl(
                "get", "events", "-n", NS, "--field-selector", "involvedObject.name=demo", "-o", "json"
            ).stdout
        )["items"]
        assert any(e["reason"] == EVENT_APPLIED and RAISE in e["message"] for e in events)
        assert any(e["reason"] == EVENT_REVERTED and e["type"] == "Warning" for e in events), [
            e["reason"] for e in events
        ]
        # The engine container was restarted once on the OOM kill (the node's runtime did it).
        assert [name for name, _ in node.started].count(second["metadata"]["name"]) == 1
        # The operator changed the Deployment twice after creating it: the raise and the revert.
        patches = [
            e
            for e in cluster.audit(OPERATOR_USER, resource="deployments", namespace=NS, name="demo")
            if e["verb"] == "patch" and not e["objectRef"].get("subresource")
        ]
        assert len(patches) == 3, [e["requestReceivedTimestamp"] for e in patches]
        assert operator.proc.poll() is None
    finally:
        operator.stop()
        node.stop()
        print(f"\n--- operator log tail ---\n{operator.log[-3000:]}\nnode errors: {node.errors[-5:]}")
    assert leftovers(pids) == [], "engine processes outlived their pods"
