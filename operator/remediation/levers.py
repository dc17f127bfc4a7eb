"""The storm's levers, for the remediation policy (:mod:`~kvpilot.operator.remediation.policy`): the
ladder of per-pod changes (:func:`storm_ladder`: the memory fraction, a live relief, maxNumSeqs, the
token budget, tensor and pipeline parallelism, then a replica), the live relief in force, and the plan
consulted in place of a rung (:func:`plannable`, :func:`consult_plan`). Pure, as the policy is.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from kvpilot.engine.parallel.layout import allowed_tensor_parallel_sizes
from kvpilot.operator.api.effective import Effective
from kvpilot.operator.api.settings import RemediationSettings
from kvpilot.operator.api.spec import ENGINE_KEYS
from kvpilot.operator.remediation.decision import (
    ADD_REPLICA,
    AUTO,
    LOWER_MAX_BATCHED_TOKENS,
    LOWER_MAX_NUM_SEQS,
    RAISE_GPU_MEMORY,
    RAISE_PP,
    RAISE_TP,
    RELIEVE_MAX_NUM_SEQS,
    REVERT,
    Change,
)
from kvpilot.operator.remediation.metrics import ModelShape
from kvpilot.operator.remediation.planned import LADDER, PLAN, Planner, PlanQuestion, PlanVerdict
from kvpilot.operator.remediation.window import MetricWindow

# Step sizes. The memory fraction moves in steps of 0.05 (on an 80 GiB GPU: 4 GiB more KV cache);
# the batch limits shrink to 3/4, maxNumSeqs to 3/4 of what actually ran during the storm (lowering it
# above the observed concurrency would change nothing).
GPU_MEMORY_STEP = 0.05
SHRINK = 0.75


@dataclasses.dataclass(frozen=True)
class Step:
    lever: str
    field: str
    from_: float
    to: float
    why: str


def fmt(value: float | None) -> str:
    if value is None:
        return "unset"
    return f"{value:g}" if isinstance(value, float) else str(value)


def engine_value(effective: Effective, key: str, reported: int | None = None) -> Any:
    value = effective.engine.get(key)
    if value is not None:
        return value
    if reported is not None:
        return reported
    return ENGINE_KEYS[key].default


def reverted(history: list[Change], field: str, generation: int | None) -> bool:
    return any(c.lever == REVERT and c.field == field and c.generation == generation for c in history)


def tensor_parallel_step(shape: ModelShape | None, tp: int, max_tp: int, skipped: list[str]) -> Step | None:
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
    return Step(RAISE_TP, "tensorParallelSize", tp, sizes[0], why)


def relief_target(window: MetricWindow, seqs: int, floor: int) -> tuple[int, str]:
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
class Relief:
    """A live relief in force: ``first`` began it (its ``from_`` is where maxNumSeqs returns to),
    ``latest`` set the value in force, ``durable`` is the restart lever that followed it (None: due)."""

    first: Change
    latest: Change
    durable: Change | None


def relief_in_force(history: list[Change], effective: Effective) -> Relief | None:
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
    return Relief(first=reliefs[-1], latest=reliefs[0], durable=durable)


def gpu_memory_step(
    window: MetricWindow, s: RemediationSettings, effective: Effective, history: list[Change], why: str
) -> tuple[Step | None, str | None]:
    """One step up of gpuMemoryUtilization, or None and why it cannot move."""
    gmu = float(engine_value(effective, "gpuMemoryUtilization"))
    limit = s.limits.max_gpu_memory_utilization
    explicit = [
        k for k in ("numGpuBlocksOverride", "kvCacheMemoryBytes") if effective.engine.get(k) is not None
    ]
    if explicit or (window.capacity is not None and window.capacity.explicit_size):
        named = explicit[0] if explicit else "numGpuBlocksOverride"
        return None, f"the KV cache is sized explicitly ({named}): gpuMemoryUtilization does not change it"
    if gmu >= limit:
        return None, f"gpuMemoryUtilization {gmu:g} is at its limit {limit:g}"
    if reverted(history, "gpuMemoryUtilization", effective.generation):
        return None, "gpuMemoryUtilization was reverted after pods failed (edit the spec to retry)"
    to = round(min(limit, gmu + GPU_MEMORY_STEP), 4)
    return Step(RAISE_GPU_MEMORY, "gpuMemoryUtilization", gmu, to, why), None


def storm_ladder(
    window: MetricWindow,
    s: RemediationSettings,
    effective: Effective,
    history: list[Change],
    scaler: str | None = None,
) -> tuple[Step | None, list[str]]:
    """The first per-pod lever (then addReplica) that can still move, and why the others cannot."""
    limits, shape, gen = s.limits, window.shape, effective.generation
    skipped: list[str] = []

    def blocked(field: str) -> bool:
        if reverted(history, field, gen):
            skipped.append(f"{field} was reverted after pods failed (edit the spec to retry)")
            return True
        return False

    # 1. A larger share of memory for the KV cache; with live levers, a live relief first (the
    # restart lever follows it, see decide).
    seqs = int(engine_value(effective, "maxNumSeqs", shape.max_num_seqs if shape else None))
    floor = limits.min_max_num_seqs
    memory, why_not = gpu_memory_step(window, s, effective, history, "more memory for the KV cache")
    if memory is not None:
        if s.live and s.mode == AUTO and seqs > floor and not reverted(history, "maxNumSeqs", gen):
            to, why = relief_target(window, seqs, floor)
            why = f"live relief now, {why}; {RAISE_GPU_MEMORY} follows after the cooldown"
            return Step(RELIEVE_MAX_NUM_SEQS, "maxNumSeqs", seqs, to, why), skipped
        return memory, skipped
    skipped.append(why_not)

    # 2. Fewer sequences at once: below what actually ran, or the change is a no-op.
    if seqs <= floor:
        skipped.append(f"maxNumSeqs {seqs} is at its floor {floor}")
    elif not blocked("maxNumSeqs"):
        base = min(seqs, math.ceil(window.running)) if window.running > 0 else seqs
        to = max(floor, min(seqs - 1, math.floor(base * SHRINK)))
        why = f"fewer concurrent sequences than the {window.running:.1f} that ran"
        return Step(LOWER_MAX_NUM_SEQS, "maxNumSeqs", seqs, to, why), skipped

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
        return Step(LOWER_MAX_BATCHED_TOKENS, "maxNumBatchedTokens", int(tokens), to, why), skipped

    # 4./5. Shard the model over more GPUs: more memory per replica for the KV cache.
    tp = int(engine_value(effective, "tensorParallelSize"))
    pp = int(engine_value(effective, "pipelineParallelSize"))
    if s.gpus_per_replica == 0:
        skipped.append("tensor/pipeline parallelism: the pods run without GPUs")
    else:
        step = tensor_parallel_step(shape, tp, limits.max_tensor_parallel_size, skipped)
        if step is not None and not blocked("tensorParallelSize"):
            return step, skipped
        layers = shape.num_hidden_layers if shape else None
        top = min(limits.max_pipeline_parallel_size, layers or limits.max_pipeline_parallel_size)
        if pp >= top:
            skipped.append(f"pipelineParallelSize {pp} is at its limit {top}")
        elif not blocked("pipelineParallelSize"):
            return Step(RAISE_PP, "pipelineParallelSize", pp, pp + 1, "one more pipeline stage"), skipped

    # 6. More replicas, unless an autoscaler owns them.
    if scaler is not None:
        skipped.append(f"replicas: {SCALERS[scaler]} owns them (spec.autoscaling)")
    elif effective.replicas >= limits.max_replicas:
        skipped.append(f"replicas {effective.replicas} is at maxReplicas {limits.max_replicas}")
    elif not blocked("replicas"):
        step = Step(ADD_REPLICA, "replicas", effective.replicas, effective.replicas + 1, "spread the load")
        return step, skipped
    return None, skipped


# The autoscalers spec.autoscaling hands replicas to (Settings.autoscaling_kind), in words.
SCALERS = {"hpa": "the HorizontalPodAutoscaler", "keda": "the KEDA ScaledObject"}

# The restart levers a plan may set straight to its value (planned.PlanQuestion.levers), by lever name.
PLANNED = {
    RAISE_GPU_MEMORY: "gpuMemoryUtilization",
    LOWER_MAX_NUM_SEQS: "maxNumSeqs",
    LOWER_MAX_BATCHED_TOKENS: "maxNumBatchedTokens",
    ADD_REPLICA: "replicas",
}
LEVER_OF = {field: lever for lever, field in PLANNED.items()}


def plannable(
    window: MetricWindow, s: RemediationSettings, effective: Effective, history: list[Change], can_add: bool
) -> tuple[str, ...]:
    """The levers a storm's plan may move, in the ladder's order: those that can still move within the
    limits and were not reverted. Replicas only where the ladder would reach them before sharding
    (no GPUs, or tensor and pipeline parallelism at their limits)."""
    gen, limits, shape = effective.generation, s.limits, window.shape
    out = []
    if gpu_memory_step(window, s, effective, history, "")[0] is not None:
        out.append("gpuMemoryUtilization")
    seqs = int(engine_value(effective, "maxNumSeqs", shape.max_num_seqs if shape else None))
    if seqs > limits.min_max_num_seqs and not reverted(history, "maxNumSeqs", gen):
        out.append("maxNumSeqs")
    reported = shape.max_num_batched_tokens if shape else None
    tokens = effective.engine.get("maxNumBatchedTokens") or reported
    if tokens is not None and not reverted(history, "maxNumBatchedTokens", gen):
        out.append("maxNumBatchedTokens")
    tp = int(engine_value(effective, "tensorParallelSize"))
    pp = int(engine_value(effective, "pipelineParallelSize"))
    sharded_out = tp >= limits.max_tensor_parallel_size and pp >= limits.max_pipeline_parallel_size
    if can_add and (s.gpus_per_replica == 0 or sharded_out):
        out.append("replicas")
    return tuple(out)


def consult_plan(
    planner: Planner, question: PlanQuestion, step: Step, effective: Effective
) -> tuple[Step, str, PlanVerdict]:
    """The plan's step in place of the ladder's ``step`` when the planner trusts its answer; otherwise
    the ladder's, with why. Returns (step, path, verdict)."""
    try:
        verdict = planner(question)
    except Exception as exc:  # noqa: BLE001 - a planner bug must never stop remediation: the ladder answers
        verdict = PlanVerdict(None, f"the planner failed: {exc!r}")
    change = verdict.change
    if change is None or change.field not in LEVER_OF:
        return step, LADDER, verdict
    current = effective.replicas if change.field == "replicas" else engine_value(effective, change.field)
    lever = LEVER_OF[change.field]
    to = int(change.to) if change.field in ("replicas", "maxNumSeqs", "maxNumBatchedTokens") else change.to
    return Step(lever, change.field, current, to, f"plan: {verdict.reason}"), PLAN, verdict
