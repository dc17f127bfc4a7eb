"""The remediation policy: ``decide(window, settings, history, now) -> Decision``.

Pure: no I/O, no clock (``now`` is an argument), no kopf, no Kubernetes client, no HTTP. The same
function runs in the operator and in ``kvpilot replay``; ``settings`` is the InferenceService resolved
once (``api.settings.resolve``), so the policy reads its limits and thresholds, never defaults of its own.

In the order vLLM's tuning guide prescribes::

    pods of our last change fail after it ─► revert it (at once: the policy never makes things worse)
    data missing / stale / partial / invalid ─► nothing
    demand: KV usage >= kvCacheUsageHigh and waiting/replica >= requestsWaitingHigh at every scrape,
            or waiting/replica >= requestsWaitingMin at every scrape and TTFT p99 > slo.ttftP99Seconds
            (no SLO: mean queue time > queueTimeHighSeconds), whatever the KV usage (signals.demand_of)
        ─► addReplica (up to maxReplicas; at the bound, a storm falls through to the per-pod levers)
    storm: preemptions/s per replica > preemptionRate over a full window, covering it (storm_parts)
        ─► raiseGpuMemoryUtilization ─► lowerMaxNumSeqs ─► lowerMaxNumBatchedTokens
           ─► raiseTensorParallelSize ─► raisePipelineParallelSize ─► addReplica
    idle: no preemption, no queue, KV usage below kvCacheUsageIdle all window ─► removeReplica
    (down to minReplicas; to 0 only once no request came for idleAfter: status.idleSince)
    at zero replicas: a front door's wake request (annotation wake-requested-at) newer than the last
    change ─► addReplica 0 → 1 at once (no cooldown: a client is waiting)

With ``spec.autoscaling`` (an HPA or a KEDA ScaledObject owns ``replicas``) the replica levers stand
down: demand and idleness are left to the autoscaler, and a storm's ladder ends at the per-pod levers.

With live levers (``spec.remediation.liveLevers``, runtime kvpilot, mode Auto) a storm's first answer
is a relief that costs no restart, and the restart lever follows it::

    storm ─► relieveMaxNumSeqs (live, seconds: maxNumSeqs to what the KV pool holds)
          ─► raiseGpuMemoryUtilization (rollout, one cooldown later, storm or not: the relief hides it)
          ─► restoreMaxNumSeqs (live, once that rolled out and a full window shows no storm)

With ``spec.remediation.plan`` (on by default) a storm's restart-lever change that is due is planned
rather than climbed: the planner (``planned.Planner``; the operator binds it to the traffic the pods
served since the last change) simulates the engine's own scheduler on that traffic and answers with
the one change that ends the storm, straight to its value (e.g. gpuMemoryUtilization 0.9 → 0.97 at
once instead of 0.95 now and 0.97 a cooldown later). Its answer is used only when the settings in
force are predicted as they ran; otherwise, or with too little traffic, the ladder's rung is taken,
and the reason says why (``Change.path``: plan or ladder). The live relief still comes first.

A relief only comes first when the restart lever can follow it (gpuMemoryUtilization can still rise);
otherwise the ladder runs as above and its lowerMaxNumSeqs stays.

Every condition must hold across the whole window (``MetricWindow.full``: each pod has a scrape at or
before its start). A storm is judged on counts, since a preemption counter moves in whole steps: the
window's rate (its increase over its length) must exceed ``preemptionRate``, and the preemptions must
cover the window, every part of it reaching a floor (:func:`signals.storm_parts`), so that a burst in one
part of the window or a storm that began inside it is no storm. Gauges (KV usage and queue for
demand, idleness) must hold at every scrape. A change is blamed (reverted)
only for failures of pods on its configuration that happened after it, within ``BLAME_S``.

Hysteresis, so that flapping input never flaps the output: pressure must hold over a full window,
and cover it; one change per cooldown; after a change, the next needs a window that starts after it
(per-pod changes also restart the pods, whose metrics then start afresh); a replica is removed only
when KV usage stays far below the demand threshold, and never within two cooldowns of an added one;
per-pod levers only move one way (they are never "relaxed" on idleness); a lever that was reverted
stays where it is until the user edits the spec.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable

from kvpilot.operator.api import names
from kvpilot.operator.api.settings import Settings
from kvpilot.operator.api.timefmt import format_time, parse_time
from kvpilot.operator.remediation.decision import (
    ADD_REPLICA,
    APPLY,
    AUTO,
    NONE,
    OFF,
    RECOMMEND_ACTION,
    REMOVE_REPLICA,
    RESTORE_MAX_NUM_SEQS,
    REVERT,
    Change,
    Decision,
)
from kvpilot.operator.remediation.levers import (
    PLANNED,
    SCALERS,
    Step,
    consult_plan,
    fmt,
    gpu_memory_step,
    plannable,
    relief_in_force,
    reverted,
    storm_ladder,
)
from kvpilot.operator.remediation.planned import LADDER, Planner, PlanQuestion
from kvpilot.operator.remediation.pods import RECENT_FAILURE_S
from kvpilot.operator.remediation.signals import demand_of, describe, is_idle, is_storm
from kvpilot.operator.remediation.window import MetricWindow

# The ladder's steps (levers.GPU_MEMORY_STEP, levers.SHRINK) and the storm's levers are in levers.py.
SCALE_DOWN_DELAY_COOLDOWNS = 2
# KVCachePressure stays True until the rate falls below this fraction of the threshold.
PRESSURE_EXIT_RATIO = 0.5
# A failure later than this after a change is not blamed on it.
BLAME_S = RECENT_FAILURE_S


def _idle_since(settings: Settings) -> float | None:
    """``status.idleSince`` (evaluate keeps it), None when absent or unreadable."""
    value = (settings.isvc.get("status") or {}).get("idleSince")
    try:
        return parse_time(value) if value else None
    except (TypeError, ValueError):
        return None


def _at_zero(settings: Settings, history: list[Change]) -> Decision:
    """At zero replicas no pod reports: the service wakes (addReplica 0 → 1, no cooldown: a client
    waits) for a front door's wake request newer than the last change, else nothing."""
    s = settings.remediation
    annotations = (settings.isvc.get("metadata") or {}).get("annotations") or {}
    raw = annotations.get(names.ANNOTATION_WAKE)
    try:
        wake = parse_time(raw) if raw else None
    except (TypeError, ValueError):
        wake = None
    last = history[0].time if history else float("-inf")
    if wake is None or wake <= math.floor(last):
        return Decision(NONE, "scaled to zero: no request waits at a front door")
    reason = (
        f"woken: a request has waited at a front door since {format_time(wake)}; addReplica: replicas 0 → 1"
    )
    if s.mode == OFF:
        return Decision(NONE, f"remediation is Off; would wake ({reason})", ADD_REPLICA, "replicas", 0, 1)
    action = APPLY if s.mode == AUTO else RECOMMEND_ACTION
    return Decision(action, reason, ADD_REPLICA, "replicas", 0, 1, "demand")


def decide(
    window: MetricWindow,
    settings: Settings,
    history: Iterable[Change],
    now: float,
    planner: Planner | None = None,
) -> Decision:
    """What to do about ``window`` for the InferenceService ``settings`` (valid) describes.

    ``history``: the changes made so far (``status.remediations`` in Auto, ``status.recommendations``
    in Recommend), any order. ``now``: unix seconds. ``planner``: asked, when ``spec.remediation.plan``
    is enabled, for a storm's restart-lever change that is due (not held back); its trusted answer
    replaces the ladder's rung (``planned``). Never raises for well-formed inputs.
    """
    s, effective = settings.remediation, settings.effective
    history = sorted(history, key=lambda c: c.time, reverse=True)
    last = history[0] if history else None

    # A change of ours whose pods fail after it is undone at once, cooldown or not.
    if window.failing and s.mode == AUTO and last is not None and last.lever != REVERT:
        current = effective.replicas if last.field == "replicas" else effective.engine.get(last.field)
        # Kubernetes stamps pods to the second: a failure in the second of the change counts as after it.
        since = math.floor(last.time)
        blamed = [f for f in window.failing if f.time is not None and 0 <= f.time - since <= BLAME_S]
        if (
            blamed
            and current is not None
            and float(current) == float(last.to)
            and last.generation == effective.generation
        ):
            reason = (
                f"pods of the new configuration fail ({'; '.join(map(str, blamed))}) since {last.lever} "
                f"set {last.field} {fmt(last.from_)} → {fmt(last.to)}: reverting"
            )
            return Decision(APPLY, reason, REVERT, last.field, last.to, last.from_)
    if effective.replicas == 0 and settings.autoscaling_kind is None:
        return _at_zero(settings, history)
    if window.not_running:
        return Decision(NONE, "not acting: pods fail: " + "; ".join(map(str, window.not_running)))
    if not window.is_complete:
        return Decision(NONE, "not acting on incomplete data: " + "; ".join(window.problems or ("no pods",)))

    signals = describe(window, s)
    storm, demand = is_storm(window, s), demand_of(window, s)
    pressure = "demand" if demand is not None else "storm" if storm else None
    step: Step | None = None
    # With spec.autoscaling an HPA or KEDA owns replicas: the replica levers stand down.
    scaler = settings.autoscaling_kind
    can_add = (
        scaler is None
        and effective.replicas < s.limits.max_replicas
        and not reverted(history, "replicas", effective.generation)
    )
    relief = relief_in_force(history, effective) if s.mode == AUTO else None
    question: PlanQuestion | None = None  # set where a plan may answer instead of the ladder
    if relief is not None and relief.durable is None:
        # The relief holds the storm back at the cost of concurrency: the restart lever is due.
        why = f"the restart lever after the live relief {relief.latest.from_:g} → {relief.latest.to:g}"
        step, _ = gpu_memory_step(window, s, effective, history, why)
        if step is not None:  # otherwise the relief stays, as a lowerMaxNumSeqs would
            cause = "a preemption storm" if storm else "the storm the live relief holds back"
            pressure = pressure or "storm"
            # Planned from the maxNumSeqs the relief gives back once the restart lever rolled out.
            question = PlanQuestion(("gpuMemoryUtilization",), storm, {"maxNumSeqs": relief.first.from_})
    if step is not None:
        pass
    elif relief is not None and relief.durable is not None and not storm:
        # The restart lever rolled out and a full window (see the hold below) shows no storm.
        to = relief.first.from_
        why = f"back to the {to:g} before the live relief: {relief.durable.lever} rolled out"
        step = Step(RESTORE_MAX_NUM_SEQS, "maxNumSeqs", relief.latest.to, to, why)
        cause = "relief no longer needed"
    elif demand is not None and can_add:
        step = Step(ADD_REPLICA, "replicas", effective.replicas, effective.replicas + 1, "serve the queue")
        cause = f"demand ({demand.message})"
    elif storm:
        # At maxReplicas, demand that also preempts is relieved per pod: preemption wastes the work
        # the queue is waiting for.
        cause = "a preemption storm" + (
            f" under demand at maxReplicas {s.limits.max_replicas}" if demand is not None else ""
        )
        step, skipped = storm_ladder(window, s, effective, history, scaler)
        if step is None:
            reason = f"{cause}: {signals}; every lever is at its limit: {'; '.join(skipped)}"
            return Decision(NONE, reason, pressure=pressure, exhausted=True)
        if step.lever in PLANNED:
            question = PlanQuestion(plannable(window, s, effective, history, can_add), storm)
    elif demand is not None and scaler is not None:
        owner = f"replicas are {SCALERS[scaler]}'s to change (spec.autoscaling)"
        reason = f"demand ({demand.message}): {owner}: {signals}"
        return Decision(NONE, reason, pressure=pressure)
    elif demand is not None:
        reason = (
            f"demand ({demand.message}), but replicas {effective.replicas} is at maxReplicas "
            f"{s.limits.max_replicas} (raise limits.maxReplicas): {signals}"
        )
        return Decision(NONE, reason, pressure=pressure, exhausted=True)
    elif is_idle(window, s) and scaler is not None:
        return Decision(
            NONE, f"idle: replicas are {SCALERS[scaler]}'s to change (spec.autoscaling): {signals}"
        )
    elif is_idle(window, s):
        if effective.replicas <= s.limits.min_replicas:
            return Decision(NONE, f"idle at minReplicas {s.limits.min_replicas}: {signals}")
        if effective.replicas == 1:  # minReplicas 0: the last replica goes only after idleAfter unused
            since = _idle_since(settings)
            if since is None or now - since < s.idle_after_s:
                quiet = f"no request for {now - since:.0f}s" if since is not None else "not yet quiet"
                reason = f"idle ({quiet}); scale to zero after idleAfter {s.idle_after_s:.0f}s without one"
                return Decision(NONE, f"{reason}: {signals}")
        scale_ups = [c for c in history if c.field == "replicas" and c.to > c.from_]
        hold = SCALE_DOWN_DELAY_COOLDOWNS * s.cooldown_s
        if scale_ups and now - scale_ups[0].time < hold:
            ago = now - scale_ups[0].time
            return Decision(NONE, f"idle, but a replica was added {ago:.0f}s ago (< {hold:.0f}s): {signals}")
        step = Step(REMOVE_REPLICA, "replicas", effective.replicas, effective.replicas - 1, "release a GPU")
        cause = f"sustained idleness (no preemption, no queue, KV cache below {s.kv_usage_idle:.0%})"
        if effective.replicas == 1:
            step = dataclasses.replace(step, why="scale to zero: a request at the front door wakes it")
            unused = now - (_idle_since(settings) or now)
            cause = f"no request for {unused:.0f}s (idleAfter {s.idle_after_s:.0f}s)"
    else:
        return Decision(NONE, f"stable: {signals}", pressure=pressure)

    what = f"{step.lever}: {step.field} {fmt(step.from_)} → {fmt(step.to)} ({step.why})"
    reason = f"{cause}: {signals}; {what}"
    held = None
    if s.mode == OFF:
        held = f"remediation is Off; would {what}"
    elif last is not None and now - last.time < s.cooldown_s:
        ago = now - last.time
        held = f"cooldown: the last change was {ago:.0f}s ago (cooldown {s.cooldown_s:.0f}s); next {what}"
    elif s.mode == AUTO and last is not None and window.start is not None and window.start < last.time:
        held = f"waiting for a full window after the last change; next {what}"
    if held is not None:
        return Decision(NONE, f"{held} ({signals})", step.lever, step.field, step.from_, step.to, pressure)
    path, verdict = None, None
    if question is not None and planner is not None and s.plan.enabled and question.levers:
        step, path, verdict = consult_plan(planner, question, step, effective)
        what = f"{step.lever}: {step.field} {fmt(step.from_)} → {fmt(step.to)} ({step.why})"
        if path == LADDER:
            what += f" (ladder: the plan was not used: {verdict.reason})"
        reason = f"{cause}: {signals}; {what}"
    action = APPLY if s.mode == AUTO else RECOMMEND_ACTION
    return Decision(
        action, reason, step.lever, step.field, step.from_, step.to, pressure, path=path, plan=verdict
    )
