"""One remediation evaluation of an InferenceService: decide, then the status it writes and its Events.

Pure: ``evaluate(settings, window, now)`` returns the
:class:`~kvpilot.operator.remediation.decision.Decision` and an :class:`Update` — a JSON merge patch
of ``status`` (None when nothing changed) and the Events to post. The operator sends both to the API
server; ``kvpilot replay`` applies the patch to an in-memory copy,
so a replay walks through exactly the states the operator would.

Remediation owns these status fields (the reconciler owns the rest, see ``reconcile.status``)::

    signals, capacity                        what the latest window shows (every mode)
    conditions KVCachePressure, Remediating  (every mode)
    effective.overrides, remediations        Auto: the applied changes (last 20, newest first)
    recommendations                          Recommend: the proposed changes (last 20, newest first)
    recommendation                           Recommend: the latest planned settings and their prediction
    idleSince                                since when no request came (scale to zero)

Writes are kept rare: numbers are rounded (rates to 2 significant digits, KV usage to percent),
``signals.sampledAt`` moves only when a value changed (``windowSeconds`` alone does not count) or the
last one is older than ``SIGNALS_REFRESH_S``, and nothing is written for an InferenceService whose
pods were never ready.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from typing import Any

from kvpilot.operator.api import names
from kvpilot.operator.api.conditions import condition, find_condition, merge_conditions
from kvpilot.operator.api.effective import LEVERS
from kvpilot.operator.api.live import applied_by
from kvpilot.operator.api.settings import RemediationSettings, Settings
from kvpilot.operator.api.timefmt import format_time, parse_time
from kvpilot.operator.remediation.decision import (
    APPLY,
    AUTO,
    OFF,
    RECOMMEND,
    RECOMMEND_ACTION,
    REVERT,
    Change,
    Decision,
    history_from_status,
)
from kvpilot.operator.remediation.planned import PLAN, Planner
from kvpilot.operator.remediation.policy import PRESSURE_EXIT_RATIO, decide
from kvpilot.operator.remediation.signals import demand_of, is_quiet, is_storm
from kvpilot.operator.remediation.window import MetricWindow

MAX_HISTORY = 20
SIGNALS_REFRESH_S = 60.0
PRESSURE, REMEDIATING = "KVCachePressure", "Remediating"

# Event reasons.
EVENT_APPLIED = "Remediated"
EVENT_REVERTED = "RemediationReverted"
EVENT_RECOMMENDED = "RemediationRecommended"
EVENT_EXHAUSTED = "RemediationExhausted"
EVENT_PRESSURE = "KVCachePressure"


@dataclasses.dataclass(frozen=True)
class Update:
    """What to write: ``patch`` (a JSON merge patch of ``.status``, None: nothing), ``events``
    (type, reason, message) to post, and the ``change`` applied or recommended, if any."""

    patch: dict[str, Any] | None
    events: tuple[tuple[str, str, str], ...] = ()
    change: Change | None = None


def _round(value: float, digits: int = 3) -> float:
    """``value`` to ``digits`` significant digits (fewer status writes for noise)."""
    if value == 0 or not math.isfinite(value):
        return 0.0
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))


def signals_of(window: MetricWindow) -> dict[str, Any]:
    """``status.signals`` for a window (without ``sampledAt``); ``notActing`` says why the policy
    cannot act on it, when it cannot."""
    out = {
        "preemptionsPerSecond": _round(window.preemption_rate, 2),
        "kvCacheUsage": round(window.kv_usage, 2),
        "requestsWaiting": round(window.waiting, 1),
        "requestsRunning": round(window.running, 1),
        "podsReporting": len(window.pods),
        "windowSeconds": round(window.covered_s),
    }
    if not window.is_complete:
        out["notActing"] = "; ".join(window.problems or ("no data",))[:1024]
    return out


def _material(signals: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in signals.items() if k != "windowSeconds"}


def capacity_status(window: MetricWindow) -> dict[str, Any] | None:
    """``status.capacity`` from the engines' ``vllm:cache_config_info``, or None when unknown."""
    cap = window.capacity
    if cap is None:
        return None
    out: dict[str, Any] = {
        "numGpuBlocks": cap.num_gpu_blocks,
        "blockSize": cap.block_size,
        "kvCacheTokens": cap.kv_cache_tokens,
    }
    if cap.max_concurrency is not None:
        out["maxConcurrency"] = round(cap.max_concurrency, 2)
    return out


def pressure_condition(
    window: MetricWindow, s: RemediationSettings, previous: dict[str, Any] | None
) -> dict[str, Any]:
    """``KVCachePressure``: True in a storm or under demand; it clears only once the rate falls below
    half the threshold (or KV usage/queue clearly below the demand thresholds), so it does not flap."""
    if window.not_running:
        message = "; ".join(map(str, window.not_running))
        return {**condition(PRESSURE, False, "PodsFailing", message), "status": "Unknown"}
    if not window.is_complete:
        message = "; ".join(window.problems or ("no data",))
        return {**condition(PRESSURE, False, "InsufficientData", message), "status": "Unknown"}
    rate = f"{_round(window.preemption_rate)} preemptions/s per replica over {window.covered_s:.0f}s"
    if is_storm(window, s):
        return condition(PRESSURE, True, "PreemptionStorm", f"{rate} (threshold {s.preemption_rate:g})")
    demand = demand_of(window, s)
    if demand is not None:
        return condition(PRESSURE, True, "Demand", f"demand: {demand.message}")
    was = previous or {}
    if was.get("status") == "True":
        if (
            was.get("reason") == "PreemptionStorm"
            and window.preemption_rate >= s.preemption_rate * PRESSURE_EXIT_RATIO
        ):
            return condition(PRESSURE, True, "PreemptionStorm", f"subsiding: {rate}")
        if was.get("reason") == "Demand" and (
            window.kv_usage >= s.kv_usage_high - 0.1
            and window.waiting >= s.waiting_high * PRESSURE_EXIT_RATIO
        ):
            return condition(
                PRESSURE, True, "Demand", "subsiding: KV cache and queue still near the thresholds"
            )
        if was.get("reason") == "Demand" and _latency_near(window, s):
            return condition(
                PRESSURE, True, "Demand", "subsiding: requests still queue with latency near the threshold"
            )
    return condition(PRESSURE, False, "NoPressure", "no sustained preemption or queue at a full KV cache")


def _latency_near(window: MetricWindow, s: RemediationSettings) -> bool:
    """The latency demand rule's hysteresis: requests still wait (half of requestsWaitingMin on
    average) and TTFT p99 (with an SLO) or the mean queue time (without) is above half its threshold."""
    if window.waiting < s.waiting_min * PRESSURE_EXIT_RATIO:
        return False
    if s.ttft_p99_slo_s is not None:
        p99 = window.ttft_p99_s
        return p99 is not None and p99 > s.ttft_p99_slo_s * PRESSURE_EXIT_RATIO
    queue_time = window.queue_time_s
    return queue_time is not None and queue_time > s.queue_time_high_s * PRESSURE_EXIT_RATIO


def remediating_condition(
    decision: Decision,
    s: RemediationSettings,
    latest: Change | None,
    now: float,
    scaler: str | None = None,
    replicas: int | None = None,
) -> dict[str, Any]:
    """``Remediating``: True while an applied change is being evaluated (within the cooldown)."""
    if s.mode == OFF:
        return condition(REMEDIATING, False, "Disabled", "spec.remediation.mode is Off: observing only")
    if latest is not None and now - latest.time < s.cooldown_s:
        what = (
            f"{latest.lever}: {latest.field} {latest.from_:g} → {latest.to:g} at {format_time(latest.time)}"
        )
        if s.mode == AUTO:
            if latest.path is not None:
                what += " (planned)" if latest.path == PLAN else " (ladder: the plan was not used)"
            return condition(REMEDIATING, True, "Reverted" if latest.lever == REVERT else "Applied", what)
        return condition(REMEDIATING, False, "Recommended", f"recommended {what}")
    if decision.exhausted:
        return condition(REMEDIATING, False, "LeversExhausted", decision.reason[:1024])
    if replicas == 0 and scaler is None:
        message = (
            f"scaled to zero; a request at a front door wakes it ({names.ANNOTATION_WAKE} newer than the "
            "last change: addReplica 0 → 1)"
        )
        return condition(REMEDIATING, False, "ScaledToZero", message)
    if scaler is not None:
        message = (
            f"spec.autoscaling.{scaler} owns replicas: remediation never writes them and moves only the "
            "per-pod levers"
        )
        return condition(REMEDIATING, False, "AutoscalerOwnsReplicas", message)
    return condition(REMEDIATING, False, "Stable", "no change needed")


def _spec_value(spec: dict[str, Any], field: str) -> Any:
    if field == "replicas":
        return int(spec["replicas"])
    return (spec.get("engine") or {}).get(field)


def _override_patch(settings: Settings, change: Change | None, now: float) -> dict[str, Any]:
    """Overrides to write: stale ones (the user changed the field) removed, ``change`` applied."""
    spec = settings.spec
    current = ((settings.isvc.get("status") or {}).get("effective") or {}).get("overrides") or {}
    patch: dict[str, Any] = {}
    for key, override in current.items():
        if key not in LEVERS or not isinstance(override, dict):
            continue
        if override.get("specValue") != _spec_value(spec, key):
            patch[key] = None  # the user edited the field: the spec wins, the override goes
    if change is not None:
        spec_value = _spec_value(spec, change.field)
        if spec_value is not None and float(spec_value) == float(change.to):
            patch[change.field] = None  # back to what the spec says: no override needed
        else:
            entry = {"value": change.to, "time": format_time(now), "reason": change.reason[:1024]}
            if spec_value is not None:
                entry["specValue"] = spec_value
            patch[change.field] = entry
    return patch


def revert_update(settings: Settings, change: Change, why: str, now: float) -> Update:
    """Undo ``change``, a live change the pods did not all take (``why``): a ``revert`` entry first in
    ``status.remediations`` (which freezes the lever for this generation, as after a crash-looping
    rollout), the override back to the value before it, and a Warning Event. ``settings``: the
    InferenceService as written with ``change``."""
    status = settings.isvc.get("status") or {}
    reason = (
        f"pods did not take the live change {change.lever}: {change.field} {change.from_:g} → "
        f"{change.to:g} ({why}): reverting"
    )
    revert = Change(
        now, REVERT, change.field, change.to, change.from_, reason, change.generation, change.applied_by
    )
    patch: dict[str, Any] = {
        "remediations": [revert.to_status(), *(status.get("remediations") or [])][:MAX_HISTORY]
    }
    overrides = _override_patch(settings, revert, now)
    if overrides:
        patch["effective"] = {"overrides": overrides}
    return Update(patch, (("Warning", EVENT_REVERTED, reason),), revert)


def recommendation_status(decision: Decision, effective: Any, now: float) -> dict[str, Any] | None:
    """``status.recommendation`` for a planned recommendation: the levers with the planned value, the
    prediction, and the check of the settings in force; None when the decision was not planned."""
    verdict = decision.plan
    if decision.path != PLAN or verdict is None or verdict.change is None:
        return None
    settings = {key: effective.engine[key] for key in LEVERS if key != "replicas" and key in effective.engine}
    settings["replicas"] = effective.replicas
    settings[decision.field] = decision.to
    return {
        "time": format_time(now),
        "settings": settings,
        "prediction": dict(verdict.change.prediction),
        "inForce": dict(verdict.in_force),
        "reason": verdict.reason[:1024],
    }


def evaluate(
    settings: Settings,
    window: MetricWindow,
    now: float,
    *,
    observed_pods: bool = True,
    planner: Planner | None = None,
) -> tuple[Decision, Update]:
    """Decide for the InferenceService ``settings`` resolves (valid; its object as last read) on
    ``window``; the status patch and Events that follow.

    ``observed_pods``: whether any engine pod of it exists; with none and no remediation status yet,
    nothing is written (a new or stopped InferenceService has nothing to report).
    """
    isvc, effective, s = settings.isvc, settings.effective, settings.remediation
    status = isvc.get("status") or {}
    key = "recommendations" if s.mode == RECOMMEND else "remediations"
    history = history_from_status(status.get(key))
    decision = decide(window, settings, history, now, planner)
    conditions = status.get("conditions") or []
    if not observed_pods and not window.pods and find_condition(conditions, PRESSURE) is None:
        return decision, Update(None)

    patch: dict[str, Any] = {}
    events: list[tuple[str, str, str]] = []
    change = None
    if decision.action in (APPLY, RECOMMEND_ACTION):
        change = decision.change(now, effective.generation)
        if decision.action == APPLY:
            change = dataclasses.replace(
                change, applied_by=applied_by(settings.spec, change.field, change.to)
            )
        entries = [change.to_status(), *(status.get(key) or [])][:MAX_HISTORY]
        patch[key] = entries
        history = [change, *history]
        what = decision.reason
        recommendation = recommendation_status(decision, effective, now)
        if recommendation is not None and decision.action == RECOMMEND_ACTION:
            patch["recommendation"] = recommendation
        if decision.action == RECOMMEND_ACTION:
            events.append(("Normal", EVENT_RECOMMENDED, f"Recommend mode, not applied: {what}"))
        elif change.lever == REVERT:
            events.append(("Warning", EVENT_REVERTED, what))
        else:
            events.append(("Normal", EVENT_APPLIED, what))
    overrides = _override_patch(settings, change if decision.action == APPLY else None, now)
    if overrides:
        patch["effective"] = {"overrides": overrides}

    if window.pods:
        signals = signals_of(window)
        have = dict(status.get("signals") or {})
        sampled = have.pop("sampledAt", None)
        fresh = sampled is not None and now - parse_time(sampled) < SIGNALS_REFRESH_S
        # The span the samples cover moves with scrape timing (30 s, 31 s, 30 s...): alone it is not
        # worth a write, it goes with the next one.
        if _material(have) != _material(signals) or not fresh:
            patch["signals"] = {**signals, "sampledAt": format_time(window.end)}
            if "notActing" in have and "notActing" not in signals:
                patch["signals"]["notActing"] = None  # a merge patch removes a key only by null
    elif status.get("signals"):
        patch["signals"] = None  # no pod reports: old numbers would mislead
    # status.idleSince: since when no request came (scale to zero waits idleAfter on it).
    if window.pods and window.is_complete:
        if is_quiet(window) and not status.get("idleSince"):
            patch["idleSince"] = format_time(window.start if window.start is not None else window.end)
        elif not is_quiet(window) and status.get("idleSince"):
            patch["idleSince"] = None
    capacity = capacity_status(window)
    if capacity is not None and status.get("capacity") != capacity:
        patch["capacity"] = capacity

    previous_pressure = find_condition(conditions, PRESSURE)
    previous_remediating = find_condition(conditions, REMEDIATING)
    pressure = pressure_condition(window, s, previous_pressure)
    latest = history[0] if history else None
    replicas = effective.replicas + (
        int(decision.to - decision.from_) if decision.action == APPLY and decision.field == "replicas" else 0
    )
    remediating = remediating_condition(decision, s, latest, now, settings.autoscaling_kind, replicas)
    merged = merge_conditions(
        conditions,
        [pressure, remediating],
        (isvc.get("metadata") or {}).get("generation"),
        datetime.datetime.fromtimestamp(now, datetime.UTC),
    )
    if merged != conditions:
        patch["conditions"] = merged
    if pressure["status"] == "True" and (previous_pressure or {}).get("status") != "True":
        events.append(("Warning", EVENT_PRESSURE, pressure["message"]))
    if remediating["reason"] == "LeversExhausted" and (previous_remediating or {}).get("reason") != (
        "LeversExhausted"
    ):
        events.append(("Warning", EVENT_EXHAUSTED, remediating["message"]))
    return decision, Update(patch or None, tuple(events), change)
