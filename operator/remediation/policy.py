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
from typing import Any

from kvpilot.engine.parallel.layout import allowed_tensor_parallel_sizes
from kvpilot.operator.api import names
from kvpilot.operator.api.effective import Effective
from kvpilot.operator.api.settings import RemediationSettings, Settings
from kvpilot.operator.api.spec import ENGINE_KEYS
from kvpilot.operator.api.timefmt import format_time, parse_time
from kvpilot.operator.remediation.decision import (
    ADD_REPLICA,
    APPLY,
    AUTO,
    LOWER_MAX_BATCHED_TOKENS,
    LOWER_MAX_NUM_SEQS,
    NONE,
    OFF,
    RAISE_GPU_MEMORY,
    RAISE_PP,
    RAISE_TP,
    RECOMMEND_ACTION,
    RELIEVE_MAX_NUM_SEQS,
    REMOVE_REPLICA,
    RESTORE_MAX_NUM_SEQS,
    REVERT,
    Change,
    Decision,
)
from kvpilot.operator.remediation.metrics import ModelShape
from kvpilot.operator.remediation.planned import LADDER, PLAN, Planner, PlanQuestion, PlanVerdict
from kvpilot.operator.remediation.pods import RECENT_FAILURE_S
from kvpilot.operator.remediation.signals import demand_of, describe, is_idle, is_storm
from kvpilot.operator.remediation.window import MetricWindow

# Step sizes. The memory fraction moves in steps of 0.05 (on an 80 GiB GPU: 4 GiB more KV cache);
# the batch limits shrink to 3/4, maxNumSeqs to 3/4 of what actually ran during the storm (lowering it
# above the observed concurrency would change nothing).
GPU_MEMORY_STEP = 0.05
SHRINK = 0.75
SCALE_DOWN_DELAY_COOLDOWNS = 2
# KVCachePressure stays True until the rate falls below this fraction of the threshold.
PRESSURE_EXIT_RATIO = 0.5
# A failure later than this after a change is not blamed on it.
BLAME_S = RECENT_FAILURE_S


@dataclasses.dataclass(frozen=True)
class _Step:
    lever: str
    field: str
    from_: float
    to: float
    why: str


def _fmt(value: float | None) -> str:
    if value is None:
        return "unset"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _engine_value(effective: Effective, key: str, reported: int | None = None) -> Any:
    value = effective.engine.get(key)
    if value is not None:
        return value
    if reported is not None:
        return reported
    return ENGINE_KEYS[key].default


def _reverted(history: list[Change], field: str, generation: int | None) -> bool:
    return any(c.lever == REVERT and c.field == field and c.generation == generation for c in history)


def _tensor_parallel_step(shape: ModelShape | None, tp: int, max_tp: int, skipped: list[str]) -> _Step | None:
    """The next tensor-parallel size the engine accepts for this model (its own rule:
    ``allowed_tensor_parallel_sizes``), or None with the reason appended to ``skipped``."""
    counts = (shape.num_attention_heads, shape.num_key_value_heads, shape.intermediate_size) if shape else ()
    if not counts or None in counts[:2]:
        skipped.append("tensorParallelSize: the model's head counts are unknown (no model info metric)")
        return None
    if counts[2] is None:
        skipped.append("tensorParallelSize: the model's intermediate size is unknown (no model info label)")
        return None
    heads, kv_heads, intermediate = counts
    sizes = [t for t in allowed_tensor_parallel_sizes(heads, kv_heads, intermediate) if tp < t <= max_tp]
    if not sizes:
        skipped.append(
            f"tensorParallelSize {tp}: no larger size up to {max_tp} splits {heads} attention heads, "
            f"{kv_heads} KV heads and intermediate size {intermediate} evenly"
        )
        return None
    how = "divide" if kv_heads % sizes[0] == 0 else "are replicated over"
    why = f"shard over {sizes[0]} GPUs ({kv_heads} KV heads {how} them)"
    return _Step(RAISE_TP, "tensorParallelSize", tp, sizes[0], why)


def _relief_target(window: MetricWindow, seqs: int, floor: int) -> tuple[int, str]:
    """maxNumSeqs for a live relief: what the KV pool holds at the mean length of the requests that
    finished in the window (when both are known), and never above the shrink rule of lowerMaxNumSeqs."""
    base = min(seqs, math.ceil(window.running)) if window.running > 0 else seqs
    target = math.floor(base * SHRINK)
    why = f"fewer concurrent sequences than the {window.running:.1f} that ran"
    cap, mean = window.capacity, window.mean_request_tokens
    if cap is not None and cap.block_size > 0 and mean is not None and mean > 0:
        per_request = max(1, math.ceil(mean / cap.block_size))
        fits = cap.num_gpu_blocks // per_request
        if fits < target:
            target = fits
            why = (
                f"what the KV pool holds: {cap.num_gpu_blocks} blocks / {per_request} per request "
                f"(mean {mean:.0f} tokens)"
            )
    return max(floor, min(seqs - 1, target)), why


@dataclasses.dataclass(frozen=True)
class _Relief:
    """A live relief in force: ``first`` began it (its ``from_`` is where maxNumSeqs returns to),
    ``latest`` set the value in force, ``durable`` is the restart lever that followed it (None: due)."""

    first: Change
    latest: Change
    durable: Change | None


def _relief_in_force(history: list[Change], effective: Effective) -> _Relief | None:
    """The relief the pods run under, from ``history`` (newest first): relieveMaxNumSeqs entries of
    this generation back to the last other change of maxNumSeqs, the latest one still in force."""
    reliefs: list[Change] = []
    durable: Change | None = None
    for change in history:
        if change.generation != effective.generation:
            break
        if change.field == "maxNumSeqs":
            if change.lever != RELIEVE_MAX_NUM_SEQS:
                break
            reliefs.append(change)
        elif change.field == "gpuMemoryUtilization" and not reliefs and durable is None:
            durable = change if change.lever == RAISE_GPU_MEMORY else None
            if change.lever == REVERT:
                return None  # the restart lever failed: the relief stays, as a lowering would
    if not reliefs or effective.engine.get("maxNumSeqs") != reliefs[0].to:
        return None
    return _Relief(first=reliefs[-1], latest=reliefs[0], durable=durable)


def _gpu_memory_step(
    window: MetricWindow, s: RemediationSettings, effective: Effective, history: list[Change], why: str
) -> tuple[_Step | None, str | None]:
    """One step up of gpuMemoryUtilization, or None and why it cannot move."""
    gmu = float(_engine_value(effective, "gpuMemoryUtilization"))
    limit = s.limits.max_gpu_memory_utilization
    explicit = [
        k for k in ("numGpuBlocksOverride", "kvCacheMemoryBytes") if effective.engine.get(k) is not None
    ]
    if explicit or (window.capacity is not None and window.capacity.explicit_size):
        named = explicit[0] if explicit else "numGpuBlocksOverride"
        return None, f"the KV cache is sized explicitly ({named}): gpuMemoryUtilization does not change it"
    if gmu >= limit:
        return None, f"gpuMemoryUtilization {gmu:g} is at its limit {limit:g}"
    if _reverted(history, "gpuMemoryUtilization", effective.generation):
        return None, "gpuMemoryUtilization was reverted after pods failed (edit the spec to retry)"
    to = round(min(limit, gmu + GPU_MEMORY_STEP), 4)
    return _Step(RAISE_GPU_MEMORY, "gpuMemoryUtilization", gmu, to, why), None


def _storm_ladder(
    window: MetricWindow,
    s: RemediationSettings,
    effective: Effective,
    history: list[Change],
    scaler: str | None = None,
) -> tuple[_Step | None, list[str]]:
    """The first per-pod lever (then addReplica) that can still move, and why the others cannot."""
    limits, shape, gen = s.limits, window.shape, effective.generation
    skipped: list[str] = []

    def blocked(field: str) -> bool:
        if _reverted(history, field, gen):
            skipped.append(f"{field} was reverted after pods failed (edit the spec to retry)")
            return True
        return False

    # 1. A larger share of memory for the KV cache; with live levers, a live relief first (the
    # restart lever follows it, see decide).
    seqs = int(_engine_value(effective, "maxNumSeqs", shape.max_num_seqs if shape else None))
    floor = limits.min_max_num_seqs
    memory, why_not = _gpu_memory_step(window, s, effective, history, "more memory for the KV cache")
    if memory is not None:
        if s.live and s.mode == AUTO and seqs > floor and not _reverted(history, "maxNumSeqs", gen):
            to, why = _relief_target(window, seqs, floor)
            why = f"live relief now, {why}; {RAISE_GPU_MEMORY} follows after the cooldown"
            return _Step(RELIEVE_MAX_NUM_SEQS, "maxNumSeqs", seqs, to, why), skipped
        return memory, skipped
    skipped.append(why_not)

    # 2. Fewer sequences at once: below what actually ran, or the change is a no-op.
    if seqs <= floor:
        skipped.append(f"maxNumSeqs {seqs} is at its floor {floor}")
    elif not blocked("maxNumSeqs"):
        base = min(seqs, math.ceil(window.running)) if window.running > 0 else seqs
        to = max(floor, min(seqs - 1, math.floor(base * SHRINK)))
        why = f"fewer concurrent sequences than the {window.running:.1f} that ran"
        return _Step(LOWER_MAX_NUM_SEQS, "maxNumSeqs", seqs, to, why), skipped

    # 3. A smaller token budget per step (fewer prompts admitted at once, less activation memory).
    reported = shape.max_num_batched_tokens if shape else None
    tokens = effective.engine.get("maxNumBatchedTokens") or reported
    floor = max(limits.min_max_num_batched_tokens, seqs)
    if effective.engine.get("enableChunkedPrefill") is False:
        max_len = effective.engine.get("maxModelLen") or (shape.max_model_len if shape else None)
        floor = max(floor, max_len or 0)  # without chunking a whole prompt must fit one step
    if tokens is None:
        skipped.append("maxNumBatchedTokens is unknown (not in spec, not reported by the engine)")
    elif int(tokens) <= floor:
        skipped.append(f"maxNumBatchedTokens {int(tokens)} is at its floor {floor}")
    elif not blocked("maxNumBatchedTokens"):
        to = max(floor, math.floor(int(tokens) * SHRINK))
        why = "a smaller token budget per step"
        return _Step(LOWER_MAX_BATCHED_TOKENS, "maxNumBatchedTokens", int(tokens), to, why), skipped

    # 4./5. Shard the model over more GPUs: more memory per replica for the KV cache.
    tp = int(_engine_value(effective, "tensorParallelSize"))
    pp = int(_engine_value(effective, "pipelineParallelSize"))
    if s.gpus_per_replica == 0:
        skipped.append("tensor/pipeline parallelism: the pods run without GPUs")
    else:
        step = _tensor_parallel_step(shape, tp, limits.max_tensor_parallel_size, skipped)
        if step is not None and not blocked("tensorParallelSize"):
            return step, skipped
        layers = shape.num_hidden_layers if shape else None
        top = min(limits.max_pipeline_parallel_size, layers or limits.max_pipeline_parallel_size)
        if pp >= top:
            skipped.append(f"pipelineParallelSize {pp} is at its limit {top}")
        elif not blocked("pipelineParallelSize"):
            return _Step(RAISE_PP, "pipelineParallelSize", pp, pp + 1, "one more pipeline stage"), skipped

    # 6. More replicas, unless an autoscaler owns them.
    if scaler is not None:
        skipped.append(f"replicas: {_SCALERS[scaler]} owns them (spec.autoscaling)")
    elif effective.replicas >= limits.max_replicas:
        skipped.append(f"replicas {effective.replicas} is at maxReplicas {limits.max_replicas}")
    elif not blocked("replicas"):
        step = _Step(ADD_REPLICA, "replicas", effective.replicas, effective.replicas + 1, "spread the load")
        return step, skipped
    return None, skipped


# The autoscalers spec.autoscaling hands replicas to (Settings.autoscaling_kind), in words.
_SCALERS = {"hpa": "the HorizontalPodAutoscaler", "keda": "the KEDA ScaledObject"}

# The restart levers a plan may set straight to its value (planned.PlanQuestion.levers), by lever name.
_PLANNED = {
    RAISE_GPU_MEMORY: "gpuMemoryUtilization",
    LOWER_MAX_NUM_SEQS: "maxNumSeqs",
    LOWER_MAX_BATCHED_TOKENS: "maxNumBatchedTokens",
    ADD_REPLICA: "replicas",
}
_LEVER_OF = {field: lever for lever, field in _PLANNED.items()}


def _plannable(
    window: MetricWindow, s: RemediationSettings, effective: Effective, history: list[Change], can_add: bool
) -> tuple[str, ...]:
    """The levers a storm's plan may move, in the ladder's order: those that can still move within the
    limits and were not reverted. Replicas only where the ladder would reach them before sharding
    (no GPUs, or tensor and pipeline parallelism at their limits)."""
    gen, limits, shape = effective.generation, s.limits, window.shape
    out = []
    if _gpu_memory_step(window, s, effective, history, "")[0] is not None:
        out.append("gpuMemoryUtilization")
    seqs = int(_engine_value(effective, "maxNumSeqs", shape.max_num_seqs if shape else None))
    if seqs > limits.min_max_num_seqs and not _reverted(history, "maxNumSeqs", gen):
        out.append("maxNumSeqs")
    reported = shape.max_num_batched_tokens if shape else None
    tokens = effective.engine.get("maxNumBatchedTokens") or reported
    if tokens is not None and not _reverted(history, "maxNumBatchedTokens", gen):
        out.append("maxNumBatchedTokens")
    tp = int(_engine_value(effective, "tensorParallelSize"))
    pp = int(_engine_value(effective, "pipelineParallelSize"))
    sharded_out = tp >= limits.max_tensor_parallel_size and pp >= limits.max_pipeline_parallel_size
    if can_add and (s.gpus_per_replica == 0 or sharded_out):
        out.append("replicas")
    return tuple(out)


def _consult_plan(
    planner: Planner, question: PlanQuestion, step: _Step, effective: Effective
) -> tuple[_Step, str, PlanVerdict]:
    """The plan's step in place of the ladder's ``step`` when the planner trusts its answer; otherwise
    the ladder's, with why. Returns (step, path, verdict)."""
    try:
        verdict = planner(question)
    except Exception as exc:  # noqa: BLE001 - a planner bug must never stop remediation: the ladder answers
        verdict = PlanVerdict(None, f"the planner failed: {exc!r}")
    change = verdict.change
    if change is None or change.field not in _LEVER_OF:
        return step, LADDER, verdict
    current = effective.replicas if change.field == "replicas" else _engine_value(effective, change.field)
    lever = _LEVER_OF[change.field]
    to = int(change.to) if change.field in ("replicas", "maxNumSeqs", "maxNumBatchedTokens") else change.to
    return _Step(lever, change.field, current, to, f"plan: {verdict.reason}"), PLAN, verdict


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
                f"set {last.field} {_fmt(last.from_)} → {_fmt(last.to)}: reverting"
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
    step: _Step | None = None
    # With spec.autoscaling an HPA or KEDA owns replicas: the replica levers stand down.
    scaler = settings.autoscaling_kind
    can_add = (
        scaler is None
        and effective.replicas < s.limits.max_replicas
        and not _reverted(history, "replicas", effective.generation)
    )
    relief = _relief_in_force(history, effective) if s.mode == AUTO else None
    question: PlanQuestion | None = None  # set where a plan may answer instead of the ladder
    if relief is not None and relief.durable is None:
        # The relief holds the storm back at the cost of concurrency: the restart lever is due.
        why = f"the restart lever after the live relief {relief.latest.from_:g} → {relief.latest.to:g}"
        step, _ = _gpu_memory_step(window, s, effective, history, why)
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
        step = _Step(RESTORE_MAX_NUM_SEQS, "maxNumSeqs", relief.latest.to, to, why)
        cause = "relief no longer needed"
    elif demand is not None and can_add:
        step = _Step(ADD_REPLICA, "replicas", effective.replicas, effective.replicas + 1, "serve the queue")
        cause = f"demand ({demand.message})"
    elif storm:
        # At maxReplicas, demand that also preempts is relieved per pod: preemption wastes the work
        # the queue is waiting for.
        cause = "a preemption storm" + (
            f" under demand at maxReplicas {s.limits.max_replicas}" if demand is not None else ""
        )
        step, skipped = _storm_ladder(window, s, effective, history, scaler)
        if step is None:
            reason = f"{cause}: {signals}; every lever is at its limit: {'; '.join(skipped)}"
            return Decision(NONE, reason, pressure=pressure, exhausted=True)
        if step.lever in _PLANNED:
            question = PlanQuestion(_plannable(window, s, effective, history, can_add), storm)
    elif demand is not None and scaler is not None:
        owner = f"replicas are {_SCALERS[scaler]}'s to change (spec.autoscaling)"
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
            NONE, f"idle: replicas are {_SCALERS[scaler]}'s to change (spec.autoscaling): {signals}"
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
        step = _Step(REMOVE_REPLICA, "replicas", effective.replicas, effective.replicas - 1, "release a GPU")
        cause = f"sustained idleness (no preemption, no queue, KV cache below {s.kv_usage_idle:.0%})"
        if effective.replicas == 1:
            step = dataclasses.replace(step, why="scale to zero: a request at the front door wakes it")
            unused = now - (_idle_since(settings) or now)
            cause = f"no request for {unused:.0f}s (idleAfter {s.idle_after_s:.0f}s)"
    else:
        return Decision(NONE, f"stable: {signals}", pressure=pressure)

    what = f"{step.lever}: {step.field} {_fmt(step.from_)} → {_fmt(step.to)} ({step.why})"
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
        step, path, verdict = _consult_plan(planner, question, step, effective)
        what = f"{step.lever}: {step.field} {_fmt(step.from_)} → {_fmt(step.to)} ({step.why})"
        if path == LADDER:
            what += f" (ladder: the plan was not used: {verdict.reason})"
        reason = f"{cause}: {signals}; {what}"
    action = APPLY if s.mode == AUTO else RECOMMEND_ACTION
    return Decision(
        action, reason, step.lever, step.field, step.from_, step.to, pressure, path=path, plan=verdict
    )
