"""What one remediation evaluation writes (pure): status patches, conditions, Events; and pod triage."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from kvpilot.operator.api import names
from kvpilot.operator.api.patch import merge_patch
from kvpilot.operator.api.settings import resolve
from kvpilot.operator.api.timefmt import format_time
from kvpilot.operator.remediation.evaluate import SIGNALS_REFRESH_S, evaluate, signals_of
from kvpilot.operator.remediation.pods import (
    RECENT_FAILURE_S,
    UNSCHEDULABLE_GRACE_S,
    Failure,
    classify,
    failure_time,
    metrics_url,
    pod_failure,
)
from kvpilot.operator.remediation.window import MetricWindow
from tests.operator.crd_schema import schema_errors
from tests.operator.test_policy import DEMAND, IDLE, NOW, STORM, WINDOW_S, isvc, window


def status_of(obj: dict) -> dict:
    return obj.get("status") or {}


def run(obj: dict, win: MetricWindow, now: float = NOW, **kwargs):
    """Evaluate and apply the patch like the API server would; returns (decision, update, new object)."""
    decision, update = evaluate(resolve(obj), win, now, **kwargs)
    new = copy.deepcopy(obj)
    if update.patch is not None:
        new["status"] = merge_patch(new.get("status"), update.patch)
    return decision, update, new


def cond(obj: dict, type_: str) -> dict:
    return next(c for c in status_of(obj).get("conditions", []) if c["type"] == type_)


def test_auto_storm_writes_override_history_signals_capacity_conditions_and_events(crd_schema):
    decision, update, obj = run(isvc(), STORM)
    assert decision.action == "apply"
    status = status_of(obj)
    override = status["effective"]["overrides"]["gpuMemoryUtilization"]
    assert (override["value"], override["specValue"]) == (0.95, 0.9)
    assert resolve(obj).effective.engine["gpuMemoryUtilization"] == 0.95
    (entry,) = status["remediations"]
    assert (entry["lever"], entry["field"], entry["from"], entry["to"]) == (
        "raiseGpuMemoryUtilization",
        "gpuMemoryUtilization",
        0.9,
        0.95,
    )
    assert entry["generation"] == 5 and "a preemption storm" in entry["reason"]
    assert status["signals"]["preemptionsPerSecond"] == 0.5 and status["signals"]["podsReporting"] == 2
    assert status["capacity"] == {
        "numGpuBlocks": 2048,
        "blockSize": 16,
        "kvCacheTokens": 32768,
        "maxConcurrency": 8.0,
    }
    assert cond(obj, "KVCachePressure")["status"] == "True"
    assert cond(obj, "KVCachePressure")["reason"] == "PreemptionStorm"
    assert (cond(obj, "Remediating")["status"], cond(obj, "Remediating")["reason"]) == ("True", "Applied")
    reasons = [(t, r) for t, r, _ in update.events]
    assert reasons == [("Normal", "Remediated"), ("Warning", "KVCachePressure")]
    assert "spec" not in update.patch and update.patch.keys() <= {
        "effective",
        "remediations",
        "signals",
        "capacity",
        "conditions",
    }
    assert schema_errors(obj, crd_schema) == []


def test_an_unchanged_evaluation_writes_nothing():
    _, _, obj = run(isvc(), STORM)
    later = dataclasses.replace(STORM, end=NOW + 10, start=NOW - 110)
    decision, update = evaluate(resolve(obj), later, NOW + 10)
    assert decision.action == "none" and "cooldown" in decision.reason
    assert update.patch is None and update.events == ()
    # sampledAt is refreshed once it is old, even when the numbers stay the same.
    end = NOW + SIGNALS_REFRESH_S + 1
    much_later = dataclasses.replace(STORM, end=end, start=end - 120)
    _, update = evaluate(resolve(obj), much_later, NOW + SIGNALS_REFRESH_S + 1)
    assert set(update.patch) == {"signals"}


def test_a_window_a_second_longer_or_shorter_writes_nothing():
    """The span the samples cover moves with scrape timing (30 s, then 31 s, on kwok pods at 200
    InferenceServices): alone it is not worth a status write."""
    _, _, obj = run(isvc(), IDLE)
    for span in (WINDOW_S - 1, WINDOW_S + 1):
        jittered = dataclasses.replace(IDLE, end=NOW + 10, start=NOW + 10 - span)
        assert signals_of(jittered)["windowSeconds"] != status_of(obj)["signals"]["windowSeconds"]
        _, update = evaluate(resolve(obj), jittered, NOW + 10)
        assert update.patch is None, update.patch
    # Any other signal that moves is written.
    busier = dataclasses.replace(IDLE, end=NOW + 10, start=NOW + 10 - WINDOW_S, running=7)
    assert set(evaluate(resolve(obj), busier, NOW + 10)[1].patch) == {"signals"}


def test_recommend_writes_recommendations_and_never_overrides(crd_schema):
    decision, update, obj = run(isvc(remediation={"mode": "Recommend"}), STORM)
    assert decision.action == "recommend"
    status = status_of(obj)
    assert "effective" not in status and "remediations" not in status
    assert status["recommendations"][0]["to"] == 0.95
    assert [r for _, r, _ in update.events][0] == "RemediationRecommended"
    assert cond(obj, "Remediating")["reason"] == "Recommended"
    assert resolve(obj).effective.engine["gpuMemoryUtilization"] == 0.9
    # The same recommendation is not repeated within the cooldown.
    decision, update = evaluate(resolve(obj), STORM, NOW + 60)
    assert decision.action == "none" and (update.patch is None or "recommendations" not in update.patch)
    assert schema_errors(obj, crd_schema) == []


def test_off_observes_only():
    decision, update, obj = run(isvc(remediation={"mode": "Off"}), STORM)
    assert decision.action == "none" and "would raiseGpuMemoryUtilization" in decision.reason
    assert set(update.patch) == {"signals", "capacity", "conditions"}
    assert cond(obj, "Remediating")["reason"] == "Disabled"
    assert cond(obj, "KVCachePressure")["status"] == "True"


def test_history_is_capped_at_twenty_newest_first():
    obj = isvc()
    entry = {"lever": "addReplica", "field": "replicas", "from": 1, "to": 2}
    old = [{"time": format_time(NOW - 10_000 - i), **entry} for i in range(25)]
    obj["status"] = {"remediations": old}
    _, _, obj = run(obj, STORM)
    entries = status_of(obj)["remediations"]
    assert len(entries) == 20 and entries[0]["lever"] == "raiseGpuMemoryUtilization"


def test_a_spec_edit_drops_the_stale_override_and_the_user_wins():
    _, _, obj = run(isvc(), STORM)
    obj["spec"]["engine"]["gpuMemoryUtilization"] = 0.85  # the user (GitOps) edits the field
    obj["metadata"]["generation"] = 6
    assert resolve(obj).effective.engine["gpuMemoryUtilization"] == 0.85
    decision, update, obj = run(obj, dataclasses.replace(IDLE, end=NOW + 30), NOW + 30)
    assert update.patch["effective"]["overrides"] == {"gpuMemoryUtilization": None}
    assert "gpuMemoryUtilization" not in status_of(obj)["effective"].get("overrides", {})


def test_a_revert_to_the_spec_value_removes_the_override():
    _, _, obj = run(isvc(), STORM)
    failing = dataclasses.replace(
        STORM, failing=(Failure("llama-x", "CrashLoopBackOff (last exit: OOMKilled)", NOW + 15),)
    )
    decision, update, obj = run(obj, failing, NOW + 20)
    assert (decision.lever, decision.to) == ("revert", 0.9)
    assert update.patch["effective"]["overrides"] == {"gpuMemoryUtilization": None}
    assert resolve(obj).effective.engine["gpuMemoryUtilization"] == 0.9
    assert ("Warning", "RemediationReverted") in [(t, r) for t, r, _ in update.events]
    assert cond(obj, "Remediating")["reason"] == "Reverted"
    assert cond(obj, "KVCachePressure")["status"] == "Unknown"
    # The reverted lever is not tried again: the next storm lowers maxNumSeqs instead.
    decision, _ = evaluate(resolve(obj), dataclasses.replace(STORM, end=NOW + 700), NOW + 700)
    assert decision.field == "maxNumSeqs"


def test_pressure_condition_has_hysteresis_and_exhaustion_is_announced_once():
    obj = isvc({"gpuMemoryUtilization": 0.95, "maxNumSeqs": 16, "maxNumBatchedTokens": 2048}, replicas=4)
    obj["spec"]["remediation"]["limits"].update(maxTensorParallelSize=1, maxPipelineParallelSize=1)
    decision, update, obj = run(obj, STORM)
    assert decision.exhausted and cond(obj, "Remediating")["reason"] == "LeversExhausted"
    assert [r for _, r, _ in update.events] == ["KVCachePressure", "RemediationExhausted"]
    _, update, obj = run(obj, dataclasses.replace(STORM, end=NOW + 15), NOW + 15)
    assert update.events == ()  # no repeats while nothing changes
    # Below the threshold but above half of it: still under pressure (subsiding), no flapping.
    _, _, obj = run(obj, window(rate=0.03), NOW + 30)
    assert cond(obj, "KVCachePressure")["status"] == "True"
    assert cond(obj, "KVCachePressure")["message"].startswith("subsiding")
    _, _, obj = run(obj, window(rate=0.01), NOW + 45)
    assert (cond(obj, "KVCachePressure")["status"], cond(obj, "KVCachePressure")["reason"]) == (
        "False",
        "NoPressure",
    )


def test_incomplete_data_reports_why_and_nothing_without_pods_writes_nothing():
    problem = "0 of 2 replica(s) ready on the current configuration"
    win = MetricWindow(end=NOW, window_s=120, problems=(problem,))
    decision, update = evaluate(resolve(isvc()), win, NOW, observed_pods=False)
    assert update.patch is None  # a new service, no pod yet: nothing to report
    decision, update, obj = run(isvc(), win, observed_pods=True)
    assert decision.action == "none" and "not acting on incomplete data" in decision.reason
    pressure = cond(obj, "KVCachePressure")
    assert (pressure["status"], pressure["reason"]) == ("Unknown", "InsufficientData")
    assert "0 of 2 replica(s)" in pressure["message"]
    assert "signals" not in status_of(obj)


def test_demand_and_idle_changes_touch_replicas_only():
    _, _, obj = run(isvc(), DEMAND)
    assert status_of(obj)["effective"]["overrides"]["replicas"]["value"] == 3
    assert resolve(obj).effective.replicas == 3 and resolve(obj).effective.engine == isvc()["spec"]["engine"]


# --- pod triage ------------------------------------------------------------------------------------


def pod(name: str, template: str = "abc", ready: bool = True, **status) -> dict:
    return {
        "metadata": {
            "name": name,
            "namespace": "llm",
            "uid": f"uid-{name}",
            "labels": {names.LABEL_TEMPLATE_HASH: template},
        },
        "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": 8123}]}]},
        "status": {
            "podIP": "10.0.0.7",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            **status,
        },
    }


def crashing(reason: str, last: str | None = None) -> dict:
    status = {"name": "engine", "state": {"waiting": {"reason": reason}}, "restartCount": 3}
    if last:
        status["lastState"] = {"terminated": {"reason": last}}
    return {"containerStatuses": [status]}


def test_pods_are_classified_by_template_readiness_and_health():
    pods = [
        pod("a"),
        pod("b", template="old"),
        pod("c", ready=False),
        pod("d", ready=False, **crashing("CrashLoopBackOff", "OOMKilled")),
        {**pod("e"), "metadata": {**pod("e")["metadata"], "deletionTimestamp": "2025-01-01T00:00:00Z"}},
    ]
    result = classify(pods, "abc", NOW)
    assert [t.name for t in result.targets] == ["a"]
    assert result.targets[0].url == "http://10.0.0.7:8123/metrics"
    assert result.targets[0].key == "llm/a/uid-a"
    assert result.outdated == ("b",) and result.waiting == ("c",)
    assert [str(f) for f in result.failing] == ["d: CrashLoopBackOff (last exit: OOMKilled)"]
    assert result.problems() == [
        "pod(s) not ready: c",
        "rollout in progress: 1 pod(s) on the previous configuration",
    ]


def test_a_pod_whose_engine_container_was_edited_by_hand_is_outdated():
    template = {
        "spec": {
            "containers": [{"name": "engine", "image": "engine:1", "env": [{"name": "A", "value": "1"}]}]
        }
    }
    same, edited, silent = pod("same"), pod("edited"), pod("silent")
    same["spec"]["containers"][0].update(image="engine:1", env=[{"name": "A", "value": "1"}])
    edited["spec"]["containers"][0].update(image="someone/else:latest", env=[{"name": "A", "value": "1"}])
    result = classify([same, edited, silent], "abc", NOW, template)
    assert [t.name for t in result.targets] == ["same", "silent"] and result.outdated == ("edited",)
    assert [t.name for t in classify([edited], "abc", NOW).targets] == ["edited"]  # no template: not checked


@pytest.mark.parametrize(
    ("status", "failure"),
    [
        ({}, None),
        (crashing("ContainerCreating"), None),
        (crashing("ImagePullBackOff"), "ImagePullBackOff"),
        (
            {"containerStatuses": [{"name": "engine", "state": {"running": {}}, "restartCount": 1,
                                    "lastState": {"terminated": {"reason": "OOMKilled"}}}]},
            "OOMKilled (1 restart(s))",
        ),
        (
            {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                             "message": "0/4 nodes have 2 free nvidia.com/gpu",
                             "lastTransitionTime": format_time(NOW - 60)}]},
            None,  # the cluster autoscaler may still add a node
        ),
        (
            {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                             "message": "0/4 nodes have 2 free nvidia.com/gpu",
                             "lastTransitionTime": format_time(NOW - UNSCHEDULABLE_GRACE_S - 1)}]},
            "unschedulable for 301s: 0/4 nodes have 2 free nvidia.com/gpu",
        ),
    ],
)  # fmt: skip
def test_pod_failure(status, failure):
    obj = pod("x", ready=False)
    obj["status"] = {**obj["status"], **status}
    assert pod_failure(obj, NOW) == failure


def oom_killed(ago: float, *, ready: bool) -> dict:
    obj = pod("x", ready=ready)
    obj["metadata"]["creationTimestamp"] = format_time(NOW - 7 * 86400)
    obj["status"]["containerStatuses"] = [
        {
            "name": "engine",
            "state": {"running": {}},
            "restartCount": 1,
            "lastState": {"terminated": {"reason": "OOMKilled", "finishedAt": format_time(NOW - ago)}},
        }
    ]
    return obj


@pytest.mark.parametrize(
    ("ago", "ready", "targets", "failing", "waiting"),
    [
        (7 * 86400, True, ["x"], [], []),  # a week-old OOM kill: a healthy, scraped pod
        (7 * 86400, False, [], [], ["x"]),  # ... and when not ready, just starting
        (60, True, ["x"], [("x", NOW - 60, True)], []),  # recent: scraped, and remembered for blame
        (60, False, [], [("x", NOW - 60, False)], []),
        (RECENT_FAILURE_S + 1, True, ["x"], [], []),
    ],
)
def test_an_oom_kill_counts_only_while_recent_and_a_ready_pod_is_scraped(
    ago, ready, targets, failing, waiting
):
    result = classify([oom_killed(ago, ready=ready)], "abc", NOW)
    assert [t.name for t in result.targets] == targets
    assert [(f.pod, f.time, f.ready) for f in result.failing] == failing
    assert list(result.waiting) == waiting


def test_failure_time_is_the_termination_else_the_pod_creation():
    assert failure_time(oom_killed(60, ready=True)) == NOW - 60
    image = pod("y", ready=False, **crashing("ImagePullBackOff"))
    assert failure_time(image) is None
    image["metadata"]["creationTimestamp"] = format_time(NOW - 5)
    assert failure_time(image) == NOW - 5


def test_metrics_url_defaults_and_ipv6():
    obj = pod("x")
    obj["spec"]["containers"][0]["ports"] = []
    obj["status"]["podIP"] = "fd00::7"
    assert metrics_url(obj) == f"http://[fd00::7]:{names.HTTP_PORT}/metrics"
    del obj["status"]["podIP"]
    assert metrics_url(obj) is None


def test_bad_data_is_named_in_signals_and_the_condition_and_nothing_is_done(crd_schema):
    why = "pod llama-0: bad data in the latest scrape: invalid samples: vllm:num_preemptions_total=-1"
    decision, update, obj = run(isvc(), dataclasses.replace(STORM, problems=(why,)))
    assert decision.action == "none" and decision.reason == f"not acting on incomplete data: {why}"
    assert status_of(obj)["signals"]["notActing"] == why
    pressure = cond(obj, "KVCachePressure")
    assert (pressure["status"], pressure["message"]) == ("Unknown", why)
    assert schema_errors({**obj, "status": status_of(obj)}, crd_schema) == []
    _, update, obj = run(obj, dataclasses.replace(STORM, end=NOW + 15), NOW + 15)
    assert "notActing" not in status_of(obj)["signals"]  # complete again: the reason goes
