"""Live levers end to end: the real operator process, the kmock-served API, scripted engines that answer
``/admin/config`` as ``kvpilot serve`` does.

A live lever (runtime kvpilot, ``maxNumSeqs`` below its start-up value) is posted to every ready pod
and written to the live-config ConfigMap; the Deployment does not change. A pod that refuses makes it
a failed remediation: reverted in status and the ConfigMap, the lever frozen. With room for the restart
lever, a storm is relieved live first, and the relief ends once the restart lever rolled out.
"""

from __future__ import annotations

import base64
import json

import pytest

from tests.operator.conftest import wait_for
from tests.operator.engine_metrics import EngineMetrics, ScriptedEngine
from tests.operator.test_remediation_kmock import (
    ISVCS,
    NS,
    PODS,
    SCRAPE_INTERVAL,
    Cluster,
    events,
    flag,
    new_isvc,
    template_hash,
    wait_for_ticks,
)

KEY = "live-key-0123"
# The memory fraction is at its limit: the storm ladder's next lever is maxNumSeqs (64 → 30: 3/4 of
# the 40 sequences that ran).
AT_MEMORY_LIMIT = {"maxGpuMemoryUtilization": 0.9}


def config_map(api, name: str) -> dict:
    return api.get(f"/api/v1/namespaces/{NS}/configmaps/{name}-live-config")


def live_values(api, name: str) -> dict:
    return json.loads(config_map(api, name)["data"]["live-config.json"])


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


def storm_engine(cluster: Cluster, api_key: str | None = None) -> ScriptedEngine:
    metrics = EngineMetrics(max_num_seqs=64, num_gpu_blocks=600).set(kv=0.97, waiting=2, running=40)
    engine = ScriptedEngine(metrics, rate=5.0, api_key=api_key)
    cluster.engines.append(engine)
    return engine


def test_a_live_lever_reaches_every_pod_and_changes_no_deployment(api, cluster, operator):
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "engine-key", "namespace": NS}}
    secret["data"] = {"key": base64.b64encode(f"{KEY}\n".encode()).decode()}
    api.create(f"/api/v1/namespaces/{NS}/secrets", secret)
    isvc = new_isvc("relief", "Auto", replicas=2, limits=AT_MEMORY_LIMIT, live=True)
    isvc["spec"]["apiKeySecretRef"] = {"name": "engine-key", "key": "key"}
    before = cluster.create(isvc)
    # The operator applies the ConfigMap after the Deployment (the pods mount it optional): wait for it.
    wait_for(lambda: config_map(api, "relief"), what="the live-config ConfigMap")
    assert live_values(api, "relief") == {}
    engines = [storm_engine(cluster, api_key=KEY), storm_engine(cluster, api_key=KEY)]
    cluster.start_pod("relief", "relief-a", engines[0])
    cluster.start_pod("relief", "relief-b", engines[1])

    wait_for(lambda: all(e.updates for e in engines), timeout=20, what="the live change in both pods")
    for engine in engines:
        engine.set_rate(0.0)  # relief
        assert engine.updates == [{"max_num_seqs": 30}] and engine.config["max_num_seqs"] == 30
    isvc = wait_for(lambda: cluster.isvc_with("relief", "remediations"), what="the remediation")
    (entry,) = isvc["status"]["remediations"]
    assert (entry["lever"], entry["field"], entry["from"], entry["to"], entry["appliedBy"]) == (
        "lowerMaxNumSeqs",
        "maxNumSeqs",
        64,
        30,
        "live",
    )
    assert isvc["status"]["effective"]["maxNumSeqs"] == 30
    assert isvc["spec"]["engine"]["maxNumSeqs"] == 64, "the operator never writes spec"
    # Pods started from now on run it: the ConfigMap they read at start holds it.
    assert live_values(api, "relief") == {"max_num_seqs": 30}
    wait_for_ticks(engines[0], 8)  # past the change: the storm is over, nothing more to do
    after = cluster.deployment("relief")
    assert after["spec"] == before["spec"], "a live lever rolls nothing out"
    assert template_hash(after) == template_hash(before)
    assert after["metadata"]["annotations"] == before["metadata"]["annotations"]
    assert len(cluster.isvc("relief")["status"]["remediations"]) == 1
    assert all(len(e.updates) == 1 for e in engines)
    (event,) = events(api, "relief", "Remediated")
    assert "maxNumSeqs 64 → 30" in event["message"]
    assert ("", "secrets", "get") in api.verbs


def test_a_refused_live_change_is_reverted_and_the_lever_frozen(api, cluster, operator):
    before = cluster.create(new_isvc("refused", "Auto", limits=AT_MEMORY_LIMIT, live=True))
    engine = storm_engine(cluster)
    engine.refuse = True
    cluster.start_pod("refused", "refused-a", engine)

    def reverted() -> dict | None:
        isvc = cluster.isvc("refused")
        entries = (isvc.get("status") or {}).get("remediations") or []
        return isvc if entries and entries[0]["lever"] == "revert" else None

    isvc = wait_for(reverted, timeout=20, what="the revert")
    revert, change = isvc["status"]["remediations"][:2]
    assert (change["lever"], change["to"], change["appliedBy"]) == ("lowerMaxNumSeqs", 30, "live")
    assert (revert["field"], revert["from"], revert["to"], revert["appliedBy"]) == (
        "maxNumSeqs",
        30,
        64,
        "live",
    )
    assert "refused-a: refused: HTTP 400" in revert["reason"]
    assert "maxNumSeqs" not in isvc["status"]["effective"].get("overrides", {})
    wait_for(lambda: cluster.isvc("refused")["status"]["effective"]["maxNumSeqs"] == 64, what="64 in force")
    wait_for(lambda: live_values(api, "refused") == {}, what="the ConfigMap reverted")
    (event,) = wait_for(lambda: events(api, "refused", "RemediationReverted"), what="the Warning")
    assert event["type"] == "Warning" and "HTTP 400" in event["message"]
    # The storm goes on, past cooldowns: maxNumSeqs stays frozen (never posted again).
    # Past the cooldown the ladder moves on to the next lever (also refused here), not back to the
    # frozen one.
    wait_for(lambda: any("max_num_batched_tokens" in u for u in engine.updates), what="the next lever")
    wait_for_ticks(engine, 4)
    assert [u for u in engine.updates if "max_num_seqs" in u] == [{"max_num_seqs": 30}]
    isvc = cluster.isvc("refused")
    assert [e["lever"] for e in isvc["status"]["remediations"]].count("lowerMaxNumSeqs") == 1
    assert engine.config["max_num_seqs"] == 64
    assert cluster.deployment("refused")["spec"]["template"] == before["spec"]["template"]


def test_a_storm_is_relieved_live_then_the_restart_lever_rolls_out_and_the_relief_ends(
    api, cluster, operator
):
    """The order with live levers: relieveMaxNumSeqs in place at once, raiseGpuMemoryUtilization (a
    rollout) one cooldown later although the relief ended the storm, then restoreMaxNumSeqs in place
    once the new pods served a full window without a storm."""
    before = cluster.create(new_isvc("order", "Auto", live=True))
    first = storm_engine(cluster)
    cluster.start_pod("order", "order-a", first)

    wait_for(lambda: first.updates, timeout=20, what="the live relief")
    first.set_rate(0.0)  # relieved
    assert first.updates == [{"max_num_seqs": 30}]
    entry = cluster.isvc("order")["status"]["remediations"][0]
    assert (entry["lever"], entry["from"], entry["to"], entry["appliedBy"]) == (
        "relieveMaxNumSeqs",
        64,
        30,
        "live",
    )
    assert template_hash(cluster.deployment("order")) == template_hash(before), "the relief rolls nothing out"
    assert live_values(api, "order") == {"max_num_seqs": 30}

    # One cooldown later, with no storm left to see, the restart lever.
    after = wait_for(lambda: cluster.deployment_with("order", "0.95"), timeout=20, what="the restart lever")
    assert template_hash(after) != template_hash(before)
    assert "--max-num-seqs" in after["spec"]["template"]["spec"]["containers"][0]["args"]
    assert flag(after, "--max-num-seqs") == "64", "the template keeps the start-up value"
    entry = cluster.isvc("order")["status"]["remediations"][0]
    assert (entry["lever"], entry["field"], entry["appliedBy"]) == (
        "raiseGpuMemoryUtilization",
        "gpuMemoryUtilization",
        "rollout",
    )
    # The rollout, played as the Deployment controller would: the new pod starts with the ConfigMap's
    # values (the relief still in force), the old one goes.
    second = ScriptedEngine(EngineMetrics(max_num_seqs=64, num_gpu_blocks=700).set(kv=0.5, running=30))
    second.config["max_num_seqs"] = live_values(api, "order")["max_num_seqs"]
    cluster.engines.append(second)
    cluster.start_pod("order", "order-b", second)
    cluster.delete_pod("order-a")

    wait_for(lambda: second.updates, timeout=20, what="the relief to end")
    assert second.updates == [{"max_num_seqs": 64}] and second.config["max_num_seqs"] == 64
    isvc = cluster.isvc("order")
    levers = [(e["lever"], e["appliedBy"]) for e in reversed(isvc["status"]["remediations"])]
    assert levers == [
        ("relieveMaxNumSeqs", "live"),
        ("raiseGpuMemoryUtilization", "rollout"),
        ("restoreMaxNumSeqs", "live"),
    ]
    assert isvc["status"]["effective"]["maxNumSeqs"] == 64
    assert isvc["status"]["effective"]["gpuMemoryUtilization"] == 0.95
    assert "maxNumSeqs" not in isvc["status"]["effective"]["overrides"], "back to the spec's value"
    wait_for(lambda: live_values(api, "order") == {}, what="the ConfigMap emptied")
    assert template_hash(cluster.deployment("order")) == template_hash(after), "the restore rolls nothing out"
    assert isvc["spec"]["engine"] == {"gpuMemoryUtilization": 0.9, "maxNumSeqs": 64}, "spec is never written"


def test_a_pod_that_reports_other_live_values_than_those_in_force_is_corrected(api, cluster, operator):
    """A pod that missed a live change (not ready when it was posted, an older ConfigMap read at start,
    an operator restart between the status write and the posts) reports other values in
    ``kvpilot_config_info``: the operator posts the values in force to it, and to no other pod."""
    cluster.create(new_isvc("drift", "Auto", limits=AT_MEMORY_LIMIT, live=True))
    first = storm_engine(cluster)
    cluster.start_pod("drift", "drift-a", first)
    wait_for(lambda: first.updates, timeout=20, what="the live change")
    first.set_rate(0.0)
    assert first.updates == [{"max_num_seqs": 30}]
    # A second pod comes up with the start-up value 64 (it never heard of the change).
    late = ScriptedEngine(EngineMetrics(max_num_seqs=64, num_gpu_blocks=600).set(kv=0.5, running=20))
    cluster.engines.append(late)
    cluster.start_pod("drift", "drift-b", late)
    wait_for(lambda: late.updates, timeout=20, what="the correction")
    assert late.updates == [{"max_num_seqs": 30}] and late.config["max_num_seqs"] == 30
    wait_for_ticks(late, 6)
    assert late.updates == [{"max_num_seqs": 30}], "a pod that reports the values in force is left alone"
    assert first.updates == [{"max_num_seqs": 30}]
    isvc = cluster.isvc("drift")
    assert [e["lever"] for e in isvc["status"]["remediations"]] == ["lowerMaxNumSeqs"]
