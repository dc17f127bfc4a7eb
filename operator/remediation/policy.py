"""The remediation policy: ``decide(window, spec, effective, history, now) -> Decision``.

Pure: no I/O, no clock (``now`` is an argument), no kopf, no Kubernetes client, no HTTP. The same
function runs in the operator and in ``kvpilot replay``.

In the order vLLM's tuning guide prescribes (DESIGN §5)::

    failing pods after our last change ─► revert it (at once: the policy never makes things worse)
    data missing / stale / partial     ─► nothing
    demand: KV usage >= kvCacheUsageHigh and waiting/replica >= requestsWaitingHigh (both halves)
        ─► addReplica (up to maxReplicas; at the bound, a storm falls through to the per-pod levers)
    storm: preemptions/s per replica > preemptionRate in both halves of the window
        ─► raiseGpuMemoryUtilization ─► lowerMaxNumSeqs ─► lowerMaxNumBatchedTokens
           ─► raiseTensorParallelSize ─► raisePipelineParallelSize ─► addReplica
    idle: no preemption, no queue, KV usage below kvCacheUsageIdle all window ─► removeReplica
    (down to minReplicas)

Hysteresis, so that flapping input never flaps the output: pressure must hold in *both* halves of a
complete window; one change per cooldown; after a change, the next needs a window that starts after it
(per-pod changes also restart the pods, whose metrics then start afresh); a replica is removed only
when KV usage stays far below the demand threshold, and never within two cooldowns of an added one;
per-pod levers only move one way (they are never "relaxed" on idleness); a lever that was reverted
stays where it is until the user edits the spec.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Iterable, Mapping
from typing import Any

from kvpilot.operator.api.effective import Effective
from kvpilot.operator.api.spec import ENGINE_KEYS, apply_defaults, parse_duration
from kvpilot.operator.remediation.window import MetricWindow

AUTO, RECOMMEND, OFF = "Auto", "Recommend", "Off"
NONE, APPLY, RECOMMEND_ACTION = "none", "apply", "recommend"

# Lever names (status.remediations[].lever), in ladder order.
RAISE_GPU_MEMORY = "raiseGpuMemoryUtilization"
LOWER_MAX_NUM_SEQS = "lowerMaxNumSeqs"
LOWER_MAX_BATCHED_TOKENS = "lowerMaxNumBatchedTokens"
RAISE_TP = "raiseTensorParallelSize"
RAISE_PP = "raisePipelineParallelSize"
ADD_REPLICA = "addReplica"
REMOVE_REPLICA = "removeReplica"
REVERT = "revert"

# Step sizes. The memory fraction moves in steps of 0.05 (on an 80 GiB GPU: 4 GiB more KV cache);
# the batch limits shrink to 3/4, maxNumSeqs to 3/4 of what actually ran during the storm (lowering it
# above the observed concurrency would change nothing).
GPU_MEMORY_STEP = 0.05
SHRINK = 0.75
SCALE_DOWN_DELAY_COOLDOWNS = 2
# KVCachePressure stays True until the rate falls below this fraction of the threshold.
PRESSURE_EXIT_RATIO = 0.5


@dataclasses.dataclass(frozen=True)
class Limits:
    """``spec.remediation.limits``: the bounds the policy stays within."""

    max_gpu_memory_utilization: float = 0.95
    min_max_num_seqs: int = 16
    min_max_num_batched_tokens: int = 2048
    min_replicas: int = 1
    max_replicas: int = 8
    max_tensor_parallel_size: int = 8
    max_pipeline_parallel_size: int = 1


@dataclasses.dataclass(frozen=True)
class RemediationSettings:
    """``spec.remediation`` with the CRD's defaults, durations in seconds."""

    mode: str = RECOMMEND
    preemption_rate: float = 0.05
    window_s: float = 120.0
    cooldown_s: float = 600.0
    limits: Limits = Limits()
    kv_usage_high: float = 0.9
    waiting_high: float = 8.0
    kv_usage_idle: float = 0.3
    gpus_per_replica: int = 1

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> RemediationSettings:
        """Read an InferenceService ``spec`` (defaults applied here; the spec must be valid)."""
        full = apply_defaults(dict(spec))
        rem = full["remediation"]
        limits = rem["limits"]
        thresholds = rem["thresholds"]
        return cls(
            mode=rem["mode"],
            preemption_rate=float(rem["preemptionRate"]),
            window_s=parse_duration(rem["window"]),
            cooldown_s=parse_duration(rem["cooldown"]),
            limits=Limits(
                max_gpu_memory_utilization=float(limits["maxGpuMemoryUtilization"]),
                min_max_num_seqs=int(limits["minMaxNumSeqs"]),
                min_max_num_batched_tokens=int(limits["minMaxNumBatchedTokens"]),
                min_replicas=int(limits["minReplicas"]),
                max_replicas=int(limits["maxReplicas"]),
                max_tensor_parallel_size=int(limits["maxTensorParallelSize"]),
                max_pipeline_parallel_size=int(limits["maxPipelineParallelSize"]),
            ),
            kv_usage_high=float(thresholds["kvCacheUsageHigh"]),
            waiting_high=float(thresholds["requestsWaitingHigh"]),
            kv_usage_idle=float(thresholds["kvCacheUsageIdle"]),
            gpus_per_replica=int(full["resources"].get("gpusPerReplica", 1)),
        )


def parse_time(value: str | float | int) -> float:
    """An RFC 3339 timestamp (or unix seconds) as unix seconds."""
    if isinstance(value, int | float):
        return float(value)
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def format_time(value: float) -> str:
    """Unix seconds as RFC 3339 with milliseconds (``2025-01-02T03:04:05.123Z``)."""
    moment = datetime.datetime.fromtimestamp(value, datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


@dataclasses.dataclass(frozen=True)
class Change:
    """One entry of ``status.remediations`` (applied) or ``status.recommendations`` (proposed)."""

    time: float
    lever: str
    field: str
    from_: float
    to: float
    reason: str = ""
    generation: int | None = None

    def to_status(self) -> dict[str, Any]:
        """The status entry (``from`` and ``to`` as JSON numbers, ``time`` RFC 3339)."""
        entry = {
            "time": format_time(self.time),
            "lever": self.lever,
            "field": self.field,
            "from": self.from_,
            "to": self.to,
            "reason": self.reason[:1024],
        }
        if self.generation is not None:
            entry["generation"] = self.generation
        return entry

    @classmethod
    def from_status(cls, entry: Mapping[str, Any]) -> Change | None:
        """Parse a status entry; None for an entry that is not one (hand-edited status)."""
        try:
            return cls(
                time=parse_time(entry["time"]),
                lever=str(entry["lever"]),
                field=str(entry["field"]),
                from_=entry["from"],
                to=entry["to"],
                reason=str(entry.get("reason", "")),
                generation=entry.get("generation"),
            )
        except (KeyError, TypeError, ValueError):
            return None


def history_from_status(entries: Iterable[Mapping[str, Any]] | None) -> list[Change]:
    """``status.remediations`` (or ``recommendations``) as Changes, newest first."""
    changes = [c for c in (Change.from_status(e) for e in entries or []) if c is not None]
    return sorted(changes, key=lambda c: c.time, reverse=True)


@dataclasses.dataclass(frozen=True)
class Decision:
    """What the policy concluded at one evaluation.

    ``action``: ``none``, ``apply`` (Auto) or ``recommend`` (Recommend). ``lever``/``field``/``from_``/
    ``to`` describe the change (also filled for ``none`` when a change is held back, e.g. by the
    cooldown or mode Off: what would be done). ``pressure``: ``storm``, ``demand`` or None, what the
    window shows. ``exhausted``: pressure, but every lever is at its limit. ``reason``: for people.
    """

    action: str
    reason: str
    lever: str | None = None
    field: str | None = None
    from_: float | None = None
    to: float | None = None
    pressure: str | None = None
    exhausted: bool = False

    @property
    def is_change(self) -> bool:
        return self.action in (APPLY, RECOMMEND_ACTION)

    def change(self, now: float, generation: int | None) -> Change:
        """The history entry of this decision (only for apply / recommend)."""
        assert self.is_change and self.lever and self.field
        return Change(now, self.lever, self.field, self.from_, self.to, self.reason, generation)

    def to_json(self, time: float) -> dict[str, Any]:
        """The ``kvpilot replay --output json`` line."""
        return {
            "time": time,
            "action": self.action,
            "lever": self.lever if self.is_change else None,
            "field": self.field if self.is_change else None,
            "from": self.from_ if self.is_change else None,
            "to": self.to if self.is_change else None,
            "reason": self.reason,
        }


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


def describe(window: MetricWindow, s: RemediationSettings) -> str:
    """The window's signals in one line (decision reasons start with it)."""
    halves = ", ".join(f"{h.preemption_rate:.3g}" for h in window.halves)
    return (
        f"{window.preemption_rate:.3g} preemptions/s per replica (halves {halves}; threshold "
        f"{s.preemption_rate:g}), KV cache {window.kv_usage:.0%} (peak {window.kv_usage_max:.0%}), "
        f"{window.waiting:.1f} waiting and {window.running:.1f} running per replica, "
        f"{len(window.pods)} pod(s) over {window.covered_s:.0f}s"
    )


def is_storm(window: MetricWindow, s: RemediationSettings) -> bool:
    """Preemptions above the threshold over the window and in each of its halves."""
    return (
        window.preemption_rate > s.preemption_rate
        and bool(window.halves)
        and all(h.preemption_rate > s.preemption_rate for h in window.halves)
    )


def is_demand(window: MetricWindow, s: RemediationSettings) -> bool:
    """KV cache full and requests queueing, in each half of the window."""
    return bool(window.halves) and all(
        h.kv_usage >= s.kv_usage_high and h.waiting >= s.waiting_high for h in window.halves
    )


def is_idle(window: MetricWindow, s: RemediationSettings) -> bool:
    """No preemption, no queue, and KV usage below the idle threshold at every scrape."""
    return window.num_preemptions == 0 and window.waiting_max == 0 and window.kv_usage_max < s.kv_usage_idle


def _engine_value(effective: Effective, key: str, reported: int | None = None) -> Any:
    value = effective.engine.get(key)
    if value is not None:
        return value
    if reported is not None:
        return reported
    return ENGINE_KEYS[key].default


def _reverted(history: list[Change], field: str, generation: int | None) -> bool:
    return any(c.lever == REVERT and c.field == field and c.generation == generation for c in history)


def _storm_ladder(
    window: MetricWindow, s: RemediationSettings, effective: Effective, history: list[Change]
) -> tuple[_Step | None, list[str]]:
    """The first per-pod lever (then addReplica) that can still move, and why the others cannot."""
    limits, shape, gen = s.limits, window.shape, effective.generation
    skipped: list[str] = []

    def blocked(field: str) -> bool:
        if _reverted(history, field, gen):
            skipped.append(f"{field} was reverted after pods failed (edit the spec to retry)")
            return True
        return False

    # 1. A larger share of memory for the KV cache.
    gmu = float(_engine_value(effective, "gpuMemoryUtilization"))
    explicit = [
        k for k in ("numGpuBlocksOverride", "kvCacheMemoryBytes") if effective.engine.get(k) is not None
    ]
    if explicit or (window.capacity is not None and window.capacity.explicit_size):
        named = explicit[0] if explicit else "numGpuBlocksOverride"
        skipped.append(f"the KV cache is sized explicitly ({named}): gpuMemoryUtilization does not change it")
    elif gmu >= limits.max_gpu_memory_utilization:
        skipped.append(f"gpuMemoryUtilization {gmu:g} is at its limit {limits.max_gpu_memory_utilization:g}")
    elif not blocked("gpuMemoryUtilization"):
        to = round(min(limits.max_gpu_memory_utilization, gmu + GPU_MEMORY_STEP), 4)
        return _Step(
            RAISE_GPU_MEMORY, "gpuMemoryUtilization", gmu, to, "more memory for the KV cache"
        ), skipped

    # 2. Fewer sequences at once: below what actually ran, or the change is a no-op.
    seqs = int(_engine_value(effective, "maxNumSeqs", shape.max_num_seqs if shape else None))
    floor = limits.min_max_num_seqs
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
        heads = (shape.num_attention_heads, shape.num_key_value_heads) if shape else (None, None)
        if None in heads:
            skipped.append("tensorParallelSize: the model's head counts are unknown (no model info metric)")
        else:
            sizes = [
                t
                for t in range(tp + 1, limits.max_tensor_parallel_size + 1)
                if heads[0] % t == 0 and heads[1] % t == 0
            ]
            if not sizes:
                skipped.append(
                    f"tensorParallelSize {tp}: no larger size up to {limits.max_tensor_parallel_size} "
                    f"divides {heads[1]} KV heads and {heads[0]} attention heads"
                )
            elif not blocked("tensorParallelSize"):
                why = f"shard over {sizes[0]} GPUs ({heads[1]} KV heads divide evenly)"
                return _Step(RAISE_TP, "tensorParallelSize", tp, sizes[0], why), skipped
        layers = shape.num_hidden_layers if shape else None
        top = min(limits.max_pipeline_parallel_size, layers or limits.max_pipeline_parallel_size)
        if pp >= top:
            skipped.append(f"pipelineParallelSize {pp} is at its limit {top}")
        elif not blocked("pipelineParallelSize"):
            return _Step(RAISE_PP, "pipelineParallelSize", pp, pp + 1, "one more pipeline stage"), skipped

    # 6. More replicas.
    if effective.replicas >= limits.max_replicas:
        skipped.append(f"replicas {effective.replicas} is at maxReplicas {limits.max_replicas}")
    elif not blocked("replicas"):
        step = _Step(ADD_REPLICA, "replicas", effective.replicas, effective.replicas + 1, "spread the load")
        return step, skipped
    return None, skipped


def decide(
    window: MetricWindow,
    spec: Mapping[str, Any],
    effective: Effective,
    history: Iterable[Change],
    now: float,
) -> Decision:
    """What to do about ``window`` for an InferenceService ``spec`` running ``effective``.

    ``history``: the changes made so far (``status.remediations`` in Auto, ``status.recommendations``
    in Recommend), any order. ``now``: unix seconds. Never raises for well-formed inputs.
    """
    s = RemediationSettings.from_spec(spec)
    history = sorted(history, key=lambda c: c.time, reverse=True)
    last = history[0] if history else None

    # A change of ours whose pods fail is undone at once, cooldown or not.
    if window.failing and s.mode == AUTO and last is not None and last.lever != REVERT:
        current = effective.replicas if last.field == "replicas" else effective.engine.get(last.field)
        if (
            current is not None
            and float(current) == float(last.to)
            and last.generation == effective.generation
        ):
            reason = (
                f"pods of the new configuration fail ({'; '.join(window.failing)}) since {last.lever} "
                f"set {last.field} {_fmt(last.from_)} → {_fmt(last.to)}: reverting"
            )
            return Decision(APPLY, reason, REVERT, last.field, last.to, last.from_)
    if window.failing:
        return Decision(NONE, "not acting: pods fail: " + "; ".join(window.failing))
    if not window.is_complete:
        return Decision(NONE, "not acting on incomplete data: " + "; ".join(window.problems or ("no pods",)))

    signals = describe(window, s)
    storm, demand = is_storm(window, s), is_demand(window, s)
    pressure = "demand" if demand else "storm" if storm else None
    step: _Step | None = None
    can_add = effective.replicas < s.limits.max_replicas and not _reverted(
        history, "replicas", effective.generation
    )
    if demand and can_add:
        step = _Step(ADD_REPLICA, "replicas", effective.replicas, effective.replicas + 1, "serve the queue")
        cause = f"demand (KV cache >= {s.kv_usage_high:.0%} and >= {s.waiting_high:g} waiting per replica)"
    elif storm:
        # At maxReplicas, demand that also preempts is relieved per pod: preemption wastes the work
        # the queue is waiting for.
        cause = "a preemption storm" + (
            f" under demand at maxReplicas {s.limits.max_replicas}" if demand else ""
        )
        step, skipped = _storm_ladder(window, s, effective, history)
        if step is None:
            reason = f"{cause}: {signals}; every lever is at its limit: {'; '.join(skipped)}"
            return Decision(NONE, reason, pressure=pressure, exhausted=True)
    elif demand:
        reason = (
            f"demand, but replicas {effective.replicas} is at maxReplicas {s.limits.max_replicas} "
            f"(raise limits.maxReplicas): {signals}"
        )
        return Decision(NONE, reason, pressure=pressure, exhausted=True)
    elif is_idle(window, s):
        if effective.replicas <= s.limits.min_replicas:
            return Decision(NONE, f"idle at minReplicas {s.limits.min_replicas}: {signals}")
        scale_ups = [c for c in history if c.field == "replicas" and c.to > c.from_]
        hold = SCALE_DOWN_DELAY_COOLDOWNS * s.cooldown_s
        if scale_ups and now - scale_ups[0].time < hold:
            ago = now - scale_ups[0].time
            return Decision(NONE, f"idle, but a replica was added {ago:.0f}s ago (< {hold:.0f}s): {signals}")
        step = _Step(REMOVE_REPLICA, "replicas", effective.replicas, effective.replicas - 1, "release a GPU")
        cause = f"sustained idleness (no preemption, no queue, KV cache below {s.kv_usage_idle:.0%})"
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
    action = APPLY if s.mode == AUTO else RECOMMEND_ACTION
    return Decision(action, reason, step.lever, step.field, step.from_, step.to, pressure)
