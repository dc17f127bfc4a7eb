"""With ``spec.autoscaling`` an HPA or a KEDA ScaledObject owns ``replicas``: the policy's replica
levers stand down (no addReplica for demand or as a storm's last rung, no removeReplica when idle),
the per-pod levers still answer a storm, and the Remediating condition says who owns replicas."""

from __future__ import annotations

import pytest

from kvpilot.operator.api.settings import resolve
from kvpilot.operator.remediation.decision import APPLY, NONE
from kvpilot.operator.remediation.evaluate import evaluate
from kvpilot.operator.remediation.policy import decide
from tests.operator.test_policy import AT_TOKENS_FLOOR, DEMAND, IDLE, NOW, STORM, isvc

SCALERS = {
    "hpa": {"hpa": {"maxReplicas": 6}},
    "keda": {"keda": {"maxReplicaCount": 6, "prometheus": {"serverAddress": "http://prom:9090"}}},
}


@pytest.mark.parametrize("kind", sorted(SCALERS))
def test_replica_levers_stand_down_under_an_autoscaler(kind):
    scaled = resolve(isvc(autoscaling=SCALERS[kind]))
    assert scaled.is_valid, scaled.problems
    plain = resolve(isvc())
    assert decide(DEMAND, plain, [], NOW).lever == "addReplica"
    demand = decide(DEMAND, scaled, [], NOW)
    assert demand.action == NONE and "spec.autoscaling" in demand.reason and not demand.exhausted
    assert decide(IDLE, plain, [], NOW).lever == "removeReplica"
    idle = decide(IDLE, scaled, [], NOW)
    assert idle.action == NONE and "spec.autoscaling" in idle.reason
    # A storm still moves the per-pod levers...
    storm = decide(STORM, scaled, [], NOW)
    assert storm.action == APPLY and storm.field == "gpuMemoryUtilization"
    # ...and with them at their limits (no GPUs, so no sharding either) it never adds a replica.
    cpu = {"gpusPerReplica": 0}
    at_floor = decide(
        STORM, resolve(isvc(AT_TOKENS_FLOOR, resources=cpu, autoscaling=SCALERS[kind])), [], NOW
    )
    assert (
        at_floor.action == NONE and at_floor.exhausted and "owns them (spec.autoscaling)" in at_floor.reason
    )
    assert decide(STORM, resolve(isvc(AT_TOKENS_FLOOR, resources=cpu)), [], NOW).lever == "addReplica"


def test_the_remediating_condition_names_the_autoscaler():
    _, update = evaluate(resolve(isvc(autoscaling=SCALERS["hpa"])), IDLE, NOW)
    remediating = next(c for c in update.patch["conditions"] if c["type"] == "Remediating")
    assert remediating["reason"] == "AutoscalerOwnsReplicas" and "hpa" in remediating["message"]
    assert "replicas" not in (update.patch.get("effective") or {}).get("overrides", {})
