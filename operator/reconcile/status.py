"""InferenceService status: phase, replica counts, conditions — computed purely, patched minimally.

The operator owns these status fields: ``observedGeneration``, ``phase``, ``replicas``,
``readyReplicas``, ``selector``, the reported values in ``effective`` (not ``effective.overrides``)
and the conditions ``Ready``, ``Progressing`` and ``SpecValid``. Other writers (remediation) own
the rest; :func:`status_patch` never touches what it does not own and returns ``None`` when
nothing changed, so an unchanged object costs no write.

Phases::

    Pending      no engine pod is ready yet (model loading, image pulling, unschedulable)
    Progressing  a rollout is under way and some pods serve
    Ready        every desired replica runs the current configuration and is available
    Degraded     the rollout missed its deadline, or finished but pods stopped being available
    Stopped      replicas is 0
    Failed       the spec is invalid (SpecValid=False) or a child's name is taken by an object the
                 operator does not own; existing pods keep the last valid configuration
"""

from __future__ import annotations

import datetime
from typing import Any

from kvpilot.operator.api.conditions import condition, find_condition, merge_conditions
from kvpilot.operator.api.effective import REPORTED_ENGINE_KEYS, Effective

OWNED_CONDITIONS = ("Ready", "Progressing", "SpecValid")
OWNED_EFFECTIVE_KEYS = (*REPORTED_ENGINE_KEYS, "replicas", "basedOnGeneration")


def rollout_state(deployment: dict[str, Any] | None, desired: int) -> tuple[str, list[dict[str, Any]]]:
    """(phase, [Ready, Progressing]) from the engine Deployment's status."""
    if deployment is None:
        return "Pending", [
            condition("Ready", False, "DeploymentMissing", "the engine Deployment does not exist yet"),
            condition("Progressing", True, "Creating", "creating the engine Deployment"),
        ]
    status = deployment.get("status") or {}
    ready = int(status.get("readyReplicas") or 0)
    available = int(status.get("availableReplicas") or 0)
    updated = int(status.get("updatedReplicas") or 0)
    total = int(status.get("replicas") or 0)
    seen = int(status.get("observedGeneration") or 0) >= int(deployment["metadata"].get("generation") or 0)
    counts = f"{ready}/{desired} ready, {updated}/{desired} updated"
    progressing = find_condition(status.get("conditions"), "Progressing") or {}
    rolled_out = seen and updated >= desired and total == updated

    if desired == 0:
        still_running = total > 0
        return "Stopped", [
            condition("Ready", False, "ScaledToZero", "replicas is 0"),
            condition(
                "Progressing",
                still_running,
                "ScalingDown" if still_running else "ScaledToZero",
                f"{total} pod(s) still terminating" if still_running else "no engine pods",
            ),
        ]
    if progressing.get("status") == "False" and progressing.get("reason") == "ProgressDeadlineExceeded":
        return "Degraded", [
            condition("Ready", False, "ProgressDeadlineExceeded", f"rollout stalled: {counts}"),
            condition(
                "Progressing",
                False,
                "ProgressDeadlineExceeded",
                "new engine pods did not become ready in time; see the pods' events and logs",
            ),
        ]
    if rolled_out and available >= desired:
        return "Ready", [
            condition("Ready", True, "AllReplicasReady", counts),
            condition(
                "Progressing", False, "RolloutComplete", "every replica runs the current configuration"
            ),
        ]
    if rolled_out and progressing.get("reason") == "NewReplicaSetAvailable":
        return "Degraded", [
            condition("Ready", False, "ReplicasUnavailable", counts),
            condition(
                "Progressing", False, "RolloutComplete", "rollout finished but replicas became unavailable"
            ),
        ]
    return ("Pending" if ready == 0 else "Progressing"), [
        condition("Ready", False, "RollingOut", counts),
        condition("Progressing", True, "RollingOut", counts),
    ]


def desired_status(
    isvc: dict[str, Any],
    effective: Effective | None,
    deployment: dict[str, Any] | None,
    problems: list[str],
    selector: str,
    now: datetime.datetime,
    conflicts: list[str] | tuple[str, ...] = (),
    forbidden: list[str] | tuple[str, ...] = (),
    desired_replicas: int | None = None,
) -> dict[str, Any]:
    """The owned status fields for this reconcile (a full value for each owned key).

    ``desired_replicas``: what the rollout is measured against when an autoscaler (spec.autoscaling)
    owns the Deployment's replicas; None: ``effective.replicas``.

    ``problems`` (invalid spec) and ``conflicts`` (children owned by someone else) both block the
    rollout and make the phase ``Failed``.
    """
    generation = isvc["metadata"].get("generation")
    current = isvc.get("status") or {}
    dep_status = (deployment or {}).get("status") or {}
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "replicas": int(dep_status.get("replicas") or 0),
        "readyReplicas": int(dep_status.get("readyReplicas") or 0),
        "selector": selector,
    }
    if problems:
        message = "; ".join(problems)
        kept = " (the last valid configuration keeps serving)" if deployment is not None else ""
        status["phase"] = "Failed"
        updates = [
            condition("SpecValid", False, "InvalidSpec", message),
            condition("Ready", False, "InvalidSpec", f"the spec is invalid{kept}"),
            condition("Progressing", False, "InvalidSpec", "waiting for a valid spec"),
        ]
    else:
        assert effective is not None
        desired = effective.replicas if desired_replicas is None else desired_replicas
        phase, rollout = rollout_state(deployment, desired)
        status["phase"] = phase
        status["effective"] = effective.reported(generation)
        updates = [condition("SpecValid", True, "Valid", "the spec is valid"), *rollout]
        if conflicts:
            status["phase"] = "Failed"
            updates[1] = condition("Ready", False, "ChildConflict", "; ".join(conflicts))
        if forbidden:  # RBAC refused the operator a verb it needs (the chart's role lacks it)
            status["phase"] = "Failed"
            updates[1] = condition("Ready", False, "Forbidden", "; ".join(forbidden))
    status["conditions"] = merge_conditions(current.get("conditions"), updates, generation, now)
    if generation is None:
        del status["observedGeneration"]
    return status


def status_patch(current: dict[str, Any] | None, desired: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON merge patch that turns ``current`` into ``desired`` on the owned keys, or None."""
    current = current or {}
    patch: dict[str, Any] = {}
    for key, value in desired.items():
        if key == "effective":
            have = current.get("effective") or {}
            sub = {k: v for k, v in value.items() if have.get(k) != v}
            # Reported keys that no longer apply (e.g. maxModelLen removed) are deleted.
            sub.update({k: None for k in OWNED_EFFECTIVE_KEYS if k in have and k not in value})
            if sub:
                patch["effective"] = sub
        elif current.get(key) != value:
            patch[key] = value
    return patch or None


def blocked_message(status: dict[str, Any] | None) -> str | None:
    """The message of a ``Ready=False`` condition with reason ``ChildConflict`` or ``Forbidden``."""
    cond = find_condition((status or {}).get("conditions"), "Ready")
    if cond and cond.get("reason") in ("ChildConflict", "Forbidden"):
        return cond.get("message")
    return None


def spec_invalid_message(status: dict[str, Any] | None) -> str | None:
    """The message of a ``SpecValid=False`` condition in ``status``, or None."""
    cond = find_condition((status or {}).get("conditions"), "SpecValid")
    if cond and cond.get("status") == "False":
        return cond.get("message")
    return None
