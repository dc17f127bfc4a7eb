"""Remediation end to end in the real operator process, against the kmock-served Kubernetes API.

The tests play the controllers and kubelets the emulated API lacks: they create the engine Pod objects
(labels and template hash as a ReplicaSet would), mark them ready with ``podIP`` 127.0.0.1 and their
``http`` port pointing at a small local HTTP server serving scripted Prometheus text
(``engine_metrics.ScriptedEngine``). The operator runs with ``--scrape-interval 0.25``; each
InferenceService sets a window of seconds, not minutes.
"""

from __future__ import annotations

import copy
import re
import time

import pytest

from kvpilot.operator.api import names
from kvpilot.operator.api.timefmt import format_time, parse_time
from kvpilot.operator.remediation.pods import UNSCHEDULABLE_GRACE_S
from tests.operator.conftest import BASE_ISVC, wait_for
from tests.operator.engine_metrics import EngineMetrics, ScriptedEngine

NS = "team-r"
ISVCS = f"/apis/{names.API_VERSION}/namespaces/{NS}/inferenceservices"
PODS = f"/api/v1/namespaces/{NS}/pods"
REMEDIATION = {"preemptionRate": 0.5, "window": "2s", "cooldown": "3s"}


def deployment_path(name: str) -> str:
    return f"/apis/apps/v1/namespaces/{NS}/deployments/{name}"


def new_isvc(
    name: str, mode: str, replicas: int = 1, limits: dict | None = None, live: bool = False, **engine
) -> dict:
    """``live``: ``spec.remediation.liveLevers`` (off here, so that the ladder's levers roll out; the
    live order has its tests in test_remediation_live_kmock)."""
    isvc = copy.deepcopy(BASE_ISVC)
    isvc["metadata"] = {"name": name, "namespace": NS}
    isvc["spec"]["replicas"] = replicas
    isvc["spec"]["engine"] = {"gpuMemoryUtilization": 0.9, "maxNumSeqs": 64, **engine}
    isvc["spec"]["remediation"] = {
        **REMEDIATION,
        "mode": mode,
        "liveLevers": live,
        "limits": {"maxReplicas": 3, **(limits or {})},
    }
    return isvc


def args_of(deployment: dict) -> list[str]:
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def flag(deployment: dict, name: str) -> str:
    args = args_of(deployment)
    return args[args.index(name) + 1]


def template_hash(deployment: dict) -> str:
    return deployment["spec"]["template"]["metadata"]["labels"][names.LABEL_TEMPLATE_HASH]


def condition(isvc: dict, type_: str) -> dict:
    return next((c for c in (isvc.get("status") or {}).get("conditions", []) if c["type"] == type_), {})


def events(api, name: str, reason: str) -> list[dict]:
    listing = api.get(f"/api/v1/namespaces/{NS}/events") or {"items": []}
    return [e for e in listing["items"] if e["involvedObject"]["name"] == name and e["reason"] == reason]


SCRAPE_INTERVAL = 0.25


def wait_for_ticks(engine: ScriptedEngine, count: int) -> None:
    """Wait until ``count`` remediation ticks that scraped ``engine`` after the call have finished.

    Ticks never overlap and start at least ``SCRAPE_INTERVAL`` apart, so this also lets at least
    ``count * SCRAPE_INTERVAL`` seconds pass; the scrape that opens the next tick proves the
    ``count``-th one (its status write included) is done.
    """
    start = engine.requests
    wait_for(lambda: engine.requests >= start + count + 1, what=f"{count} remediation ticks")


class Cluster:
    """What the tests play: the Deployment controller's pods and their engines."""

    def __init__(self, api) -> None:
        self.api = api
        self.engines: list[ScriptedEngine] = []

    def isvc(self, name: str) -> dict:
        return self.api.get(f"{ISVCS}/{name}")

    def isvc_with(self, name: str, key: str) -> dict | None:
        """The InferenceService once ``status[key]`` is set, else None."""
        isvc = self.isvc(name)
        return isvc if (isvc.get("status") or {}).get(key) else None

    def deployment(self, name: str) -> dict:
        return self.api.get(deployment_path(name))

    def deployment_with(self, name: str, memory_fraction: str) -> dict | None:
        """The Deployment once its pods run ``--gpu-memory-utilization memory_fraction``, else None."""
        deployment = self.deployment(name)
        return deployment if flag(deployment, "--gpu-memory-utilization") == memory_fraction else None

    def create(self, isvc: dict) -> dict:
        self.api.create(ISVCS, isvc)
        name = isvc["metadata"]["name"]
        return wait_for(lambda: self.deployment(name), what=f"the Deployment of {name}")

    def engine(self, rate: float, **gauges) -> ScriptedEngine:
        engine = ScriptedEngine(EngineMetrics(max_num_seqs=64, num_gpu_blocks=600).set(**gauges), rate=rate)
        self.engines.append(engine)
        return engine

    def start_pod(self, isvc_name: str, pod_name: str, engine: ScriptedEngine, status: dict | None = None):
        """A pod of the Deployment's current template, ready, its http port at ``engine``."""
        deployment = self.deployment(isvc_name)
        labels = dict(deployment["spec"]["template"]["metadata"]["labels"])
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": pod_name, "namespace": NS, "labels": labels},
            "spec": {
                "containers": [
                    {
                        "name": names.ENGINE_CONTAINER,
                        "image": deployment["spec"]["template"]["spec"]["containers"][0]["image"],
                        "ports": [{"name": names.HTTP_PORT_NAME, "containerPort": engine.port}],
                    }
                ]
            },
        }
        self.api.create(PODS, pod)
        ready = {"type": "Ready", "status": "True"}
        body = {"status": {"podIP": "127.0.0.1", "phase": "Running", "conditions": [ready], **(status or {})}}
        self.api.merge_patch(f"{PODS}/{pod_name}/status", body)
        replicas = deployment["spec"]["replicas"]
        rolled = {
            "observedGeneration": deployment["metadata"]["generation"],
            "replicas": replicas,
            "updatedReplicas": replicas,
            "readyReplicas": replicas,
            "availableReplicas": replicas,
        }
        self.api.merge_patch(deployment_path(isvc_name) + "/status", {"status": rolled})

    def delete_pod(self, pod_name: str) -> None:
        self.api.delete(f"{PODS}/{pod_name}")

    def stop(self) -> None:
        for engine in self.engines:
            engine.stop()


@pytest.fixture(scope="module")
def operator(api, start_operator):
    proc = start_operator(
        [NS],
        ["--resync-interval", "30", "--scrape-interval", str(SCRAPE_INTERVAL), "--scrape-timeout", "0.5"],
    )
    wait_for(lambda: "Initial authentication has finished" in proc.log, what="the operator to log in")
    return proc


@pytest.fixture
def cluster(api, operator):
    cluster = Cluster(api)
    yield cluster
    cluster.stop()
    for item in (api.get(ISVCS) or {"items": []})["items"]:
        api.delete(f"{ISVCS}/{item['metadata']['name']}")
    for item in (api.get(PODS) or {"items": []})["items"]:
        api.delete(f"{PODS}/{item['metadata']['name']}")


def test_auto_storm_raises_the_memory_fraction_rolls_out_and_settles(api, cluster, operator):
    before = cluster.create(new_isvc("storm", "Auto"))
    engine = cluster.engine(rate=5.0, kv=0.97, waiting=2, running=40)
    cluster.start_pod("storm", "storm-a", engine)

    isvc = wait_for(lambda: cluster.isvc_with("storm", "remediations"), timeout=20, what="a remediation")
    (entry,) = isvc["status"]["remediations"]
    assert (entry["lever"], entry["field"], entry["from"], entry["to"]) == (
        "raiseGpuMemoryUtilization",
        "gpuMemoryUtilization",
        0.9,
        0.95,
    )
    override = isvc["status"]["effective"]["overrides"]["gpuMemoryUtilization"]
    assert (override["value"], override["specValue"]) == (0.95, 0.9)
    assert isvc["spec"]["engine"]["gpuMemoryUtilization"] == 0.9, "the operator never writes spec"
    measured = float(re.search(r"([0-9.]+) preemptions/s per replica", entry["reason"]).group(1))
    assert 3.5 < measured < 6.5, entry["reason"]  # the scripted engine preempts 5 times a second
    assert "KV cache 97%" in entry["reason"] and "40.0 running per replica" in entry["reason"]
    # The children are re-rendered from the effective configuration: a rollout of the new args.
    after = wait_for(lambda: cluster.deployment_with("storm", "0.95"), what="the new args")
    assert template_hash(after) != template_hash(before)
    assert after["spec"]["replicas"] == 1

    def rolling_out() -> dict | None:
        """The status while the only pod runs the previous configuration (not acted upon)."""
        isvc = cluster.isvc("storm")
        message = condition(isvc, "KVCachePressure").get("message", "")
        return isvc if "rollout in progress" in message else None

    isvc = wait_for(rolling_out, what="the rollout to be reported")
    assert condition(isvc, "KVCachePressure")["status"] == "Unknown"
    assert isvc["status"]["effective"]["gpuMemoryUtilization"] == 0.95
    assert "signals" not in isvc["status"], "no numbers from a configuration that is going away"
    remediating = condition(isvc, "Remediating")
    assert (remediating["status"], remediating["reason"]) == ("True", "Applied")
    assert isvc["status"]["capacity"]["numGpuBlocks"] == 600
    (event,) = wait_for(lambda: events(api, "storm", "Remediated"), what="the Event")
    assert event["type"] == "Normal" and "gpuMemoryUtilization 0.9 → 0.95" in event["message"]
    (warning,) = events(api, "storm", "KVCachePressure")
    assert warning["type"] == "Warning" and "preemptions/s per replica" in warning["message"]

    # Play the rollout: the old pod goes, a pod of the new template starts with a fixed engine.
    cluster.delete_pod("storm-a")
    calm = cluster.engine(rate=0.0, kv=0.6, waiting=0, running=30)
    cluster.start_pod("storm", "storm-b", calm)

    def cleared() -> dict | None:
        isvc = cluster.isvc("storm")
        return isvc if condition(isvc, "KVCachePressure").get("status") == "False" else None

    isvc = wait_for(cleared, timeout=15, what="the pressure to clear")
    signals = isvc["status"]["signals"]
    assert (signals["preemptionsPerSecond"], signals["kvCacheUsage"]) == (0, 0.6)
    assert (signals["podsReporting"], signals["requestsRunning"], signals["requestsWaiting"]) == (1, 30, 0)
    wait_for_ticks(calm, 15)  # past the 3 s cooldown, with fresh full 2 s windows: nothing more to do
    isvc = cluster.isvc("storm")
    assert len(isvc["status"]["remediations"]) == 1
    assert condition(isvc, "Remediating")["reason"] == "Stable"
    assert calm.requests > 5 and engine.requests > 5


def test_recommend_changes_no_child(api, cluster, operator):
    before = cluster.create(new_isvc("advice", "Recommend"))
    engine = cluster.engine(rate=5.0, kv=0.97, waiting=2, running=40)
    cluster.start_pod("advice", "advice-a", engine)
    isvc = wait_for(
        lambda: cluster.isvc_with("advice", "recommendations"), timeout=20, what="a recommendation"
    )
    assert isvc["status"]["recommendations"][0]["to"] == 0.95
    assert "overrides" not in isvc["status"].get("effective", {}) and "remediations" not in isvc["status"]
    assert condition(isvc, "Remediating")["reason"] == "Recommended"
    wait_for(lambda: events(api, "advice", "RemediationRecommended"), what="the Event")
    wait_for_ticks(engine, 4)  # more ticks over the same storm: still advice only
    after = cluster.deployment("advice")
    assert after["spec"] == before["spec"], "Recommend never changes a child"
    assert after["metadata"]["annotations"] == before["metadata"]["annotations"]


def test_stale_pod_blocks_action_until_it_reports_then_demand_adds_a_replica_without_rollout(
    api, cluster, operator
):
    before = cluster.create(new_isvc("demand", "Auto", replicas=2))
    busy = dict(rate=0.0, kv=0.96, waiting=12, running=64)
    healthy, broken = cluster.engine(**busy), cluster.engine(**busy)
    broken.fail = True
    cluster.start_pod("demand", "demand-a", healthy)
    cluster.start_pod("demand", "demand-b", broken)

    def reported() -> dict | None:
        isvc = cluster.isvc("demand")
        message = condition(isvc, "KVCachePressure").get("message", "")
        return isvc if "pod demand-b: metrics stale" in message else None

    isvc = wait_for(reported, timeout=15, what="the stale pod reported")
    pressure = condition(isvc, "KVCachePressure")
    assert (pressure["status"], pressure["reason"]) == ("Unknown", "InsufficientData")
    assert "HTTP 500" in pressure["message"]
    wait_for_ticks(healthy, 10)  # more than the 2 s window with one pod of two silent: no action
    assert not cluster.isvc("demand")["status"].get("remediations")

    broken.fail = False
    isvc = wait_for(lambda: cluster.isvc_with("demand", "remediations"), timeout=15, what="a new replica")
    entry = isvc["status"]["remediations"][0]
    assert (entry["lever"], entry["from"], entry["to"]) == ("addReplica", 2, 3)
    after = wait_for(
        lambda: (d := cluster.deployment("demand"))["spec"]["replicas"] == 3 and d, what="3 replicas"
    )
    assert template_hash(after) == template_hash(before), "a replica change rolls nothing out"
    assert args_of(after) == args_of(before)


def test_a_change_that_crashes_pods_is_reverted(api, cluster, operator):
    cluster.create(new_isvc("oom", "Auto"))
    cluster.start_pod("oom", "oom-a", cluster.engine(rate=5.0, kv=0.97, waiting=2, running=40))
    wait_for(lambda: cluster.deployment_with("oom", "0.95"), timeout=20, what="the memory fraction raised")
    cluster.delete_pod("oom-a")
    oom = {
        "name": names.ENGINE_CONTAINER,
        "restartCount": 2,
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"reason": "OOMKilled"}},
    }
    cluster.start_pod("oom", "oom-b", cluster.engine(rate=0.0), status={"containerStatuses": [oom]})
    deployment = wait_for(lambda: cluster.deployment_with("oom", "0.9"), timeout=10, what="the revert")
    isvc = cluster.isvc("oom")
    revert = isvc["status"]["remediations"][0]
    assert (revert["lever"], revert["from"], revert["to"]) == ("revert", 0.95, 0.9)
    assert "OOMKilled" in revert["reason"]
    assert "gpuMemoryUtilization" not in isvc["status"]["effective"].get("overrides", {})
    (event,) = wait_for(lambda: events(api, "oom", "RemediationReverted"), what="the Warning")
    assert event["type"] == "Warning"
    assert deployment["spec"]["replicas"] == 1


def test_a_change_whose_pods_stay_unschedulable_is_reverted_after_the_grace(api, cluster, operator):
    """A raised memory fraction whose new pod cannot be scheduled: while the pod has been pending for
    less than the grace (the cluster autoscaler may still add a node) it only waits; once it has been
    unschedulable for longer than that, since after the change, the change is reverted."""
    cluster.create(new_isvc("pending", "Auto"))
    cluster.start_pod("pending", "pending-a", cluster.engine(rate=5.0, kv=0.97, waiting=2, running=40))
    wait_for(
        lambda: cluster.deployment_with("pending", "0.95"), timeout=20, what="the memory fraction raised"
    )
    cluster.delete_pod("pending-a")
    # Play the clock: the change was made GRACE + 100 s ago (the record is the one the operator wrote,
    # moved back in time; the pods of the new template can only be younger than it).
    isvc = cluster.isvc("pending")
    (change,) = isvc["status"]["remediations"]
    assert change["lever"] == "raiseGpuMemoryUtilization"
    changed_at = parse_time(change["time"]) - UNSCHEDULABLE_GRACE_S - 100
    api.merge_patch(
        f"{ISVCS}/pending/status", {"status": {"remediations": [{**change, "time": format_time(changed_at)}]}}
    )

    def unschedulable(since: float) -> dict:
        return {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
            "lastTransitionTime": format_time(since),
        }

    pending = {"phase": "Pending", "conditions": [unschedulable(time.time() - 10)]}
    cluster.start_pod("pending", "pending-b", cluster.engine(rate=0.0), status=pending)

    def waiting_reported() -> dict | None:
        isvc = cluster.isvc("pending")
        message = condition(isvc, "KVCachePressure").get("message", "")
        return isvc if "pod(s) not ready: pending-b" in message else None

    isvc = wait_for(waiting_reported, timeout=15, what="the pending pod reported as not ready")
    assert len(isvc["status"]["remediations"]) == 1, "pending within the grace: no revert"
    assert flag(cluster.deployment("pending"), "--gpu-memory-utilization") == "0.95"

    # The scheduler's condition has held since 10 s after the change: past the grace now.
    since = changed_at + 10
    api.merge_patch(f"{PODS}/pending-b/status", {"status": {"conditions": [unschedulable(since)]}})
    deployment = wait_for(lambda: cluster.deployment_with("pending", "0.9"), timeout=10, what="the revert")
    isvc = cluster.isvc("pending")
    revert, first = isvc["status"]["remediations"]
    assert (revert["lever"], revert["field"], revert["from"], revert["to"]) == (
        "revert",
        "gpuMemoryUtilization",
        0.95,
        0.9,
    )
    assert first["time"] == format_time(changed_at)
    assert (
        "pending-b: unschedulable for" in revert["reason"]
        and "Insufficient nvidia.com/gpu" in revert["reason"]
    )
    assert "gpuMemoryUtilization" not in isvc["status"]["effective"].get("overrides", {})
    (event,) = wait_for(lambda: events(api, "pending", "RemediationReverted"), what="the Warning")
    assert event["type"] == "Warning" and "unschedulable" in event["message"]
    assert deployment["spec"]["replicas"] == 1


def test_rbac_covers_every_request_of_remediation(api):
    """Runs last in the module: the chart grants whatever the remediation loop used (pods list included)."""
    from tests.operator.test_operator_kmock import granted_verbs

    used = api.verbs
    assert ("", "pods", "list") in used and (names.GROUP, "inferenceservices/status", "patch") in used
    assert used - granted_verbs() == set()
