"""The planner the remediation policy consults in a storm (``spec.remediation.plan``): the one change
that ends the storm in simulation, straight to its value, or why the plan is not to be trusted.

It answers a :class:`~kvpilot.operator.remediation.planned.PlanQuestion` from the traffic the pods of
the settings in force served (the scrapes since the last change, at most ``plan.lookback``), the same
way ``kvpilot plan`` answers from a recording: the workload and the step-time model rebuilt from the
engines' own counters and histograms, the engine's scheduler and block manager run on a simulated clock.

Trusted only when:

* the traffic holds at least ``plan.minRequests`` requests, and the step time can be fitted;
* the settings in force, simulated, are predicted as the pods ran: the storm call the same as the
  window's, and output tokens/s within ``plan.maxPredictionError`` of what the pods served;
* a single change of an allowed lever keeps every ``window`` of the simulated run under half the
  storm threshold (where ``KVCachePressure`` clears) and finishes the traffic, even on a KV pool
  ``KV_HEADROOM`` smaller than the one it gives.

Levers are tried in the ladder's order (a larger KV pool before fewer sequences, before a smaller
token budget, before more replicas: GPUs cost most); for each, the smallest change that ends the
storm in simulation is found by bisection (:func:`smallest_sufficient`) -- no more change than the
simulation says is needed, in about log2 of the values' count simulations per lever.
Tensor and pipeline parallelism are not planned (the step-time model cannot say how a sharded
engine runs): they stay the ladder's.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from kvpilot.engine import metrics_names as m
from kvpilot.operator.api.settings import Settings
from kvpilot.operator.plan.calibrate import calibrate
from kvpilot.operator.plan.candidates import (
    Candidate,
    CandidateResult,
    PlanContext,
    context_of,
    evaluate,
)
from kvpilot.operator.plan.recording import PlanScrape, RecordingError, intervals_of, parse_plan_scrape
from kvpilot.operator.plan.step_time import StepTimeError
from kvpilot.operator.plan.workload import Workload, workload_from_scrapes
from kvpilot.operator.remediation.planned import (
    PlannedChange,
    Planner,
    PlanQuestion,
    PlanVerdict,
    describe_prediction,
)
from kvpilot.operator.remediation.replay import Record

# A planned setting must keep every window under this fraction of the storm threshold: the rate at
# which KVCachePressure clears (policy.PRESSURE_EXIT_RATIO), so that the plan is no near miss.
TARGET_RATIO = 0.5
# ... and do so on a KV pool this much smaller than the one it will have: the recording gives the
# length distributions, not how prompt and output lengths pair up nor how closed-loop clients
# synchronise after preemptions, and a plan that only just fits is no plan.
KV_HEADROOM = 0.15
GPU_MEMORY_RESOLUTION = 0.01
TOKEN_VALUES = 16  # token budgets tried between the one in force and the floor

_FIELD_OF = {
    "gpuMemoryUtilization": "gpu_memory_utilization",
    "maxNumSeqs": "max_num_seqs",
    "maxNumBatchedTokens": "max_num_batched_tokens",
    "replicas": "replicas",
}
PLANNED_LEVERS = tuple(_FIELD_OF)


def lever_values(field: str, ctx: PlanContext, current: Candidate) -> list[float | int]:
    """The values ``field`` may take within the limits, the smallest change first: the memory fraction
    in steps of 0.01 up to its limit, every maxNumSeqs down to its floor, at most ``TOKEN_VALUES``
    token budgets down to theirs, replicas up to ``maxReplicas``."""
    lim = ctx.limits
    if field == "gpuMemoryUtilization":
        low, top = current.gpu_memory_utilization, lim.max_gpu_memory_utilization
        steps = math.floor(round((top - low) / GPU_MEMORY_RESOLUTION, 6))
        values = [round(low + k * GPU_MEMORY_RESOLUTION, 4) for k in range(1, steps + 1)]
        if top > low and (not values or values[-1] < top):
            values.append(top)
        return values
    if field == "maxNumSeqs":
        return list(range(current.max_num_seqs - 1, lim.min_max_num_seqs - 1, -1))
    if field == "maxNumBatchedTokens":
        floor = max(lim.min_max_num_batched_tokens, current.max_num_seqs)
        if not ctx.enable_chunked_prefill:
            floor = max(floor, ctx.max_model_len)  # a whole prompt must fit one step
        cur = current.max_num_batched_tokens
        if cur <= floor:
            return []
        n = min(TOKEN_VALUES, cur - floor)
        return sorted({cur - math.ceil((cur - floor) * k / n) for k in range(1, n + 1)}, reverse=True)
    if field == "replicas":
        return list(range(current.replicas + 1, lim.max_replicas + 1))
    raise ValueError(f"not a planned lever: {field}")


def smallest_sufficient(
    values: Sequence[float | int], ends_storm: Callable[[float | int], CandidateResult | None]
) -> tuple[float | int, CandidateResult] | None:
    """The first of ``values`` (ordered from the smallest change to the largest) for which
    ``ends_storm`` gives a result, or None when the largest change does not: a bisection, since a
    larger pool, fewer sequences, a smaller budget or more replicas never add preemptions (the
    largest change is tried first, then about log2(len(values)) more)."""
    if not values:
        return None
    found = ends_storm(values[-1])
    if found is None:
        return None
    best = (values[-1], found)
    low, high = 0, len(values) - 1  # values[high] ends the storm
    while low < high:
        mid = (low + high) // 2
        got = ends_storm(values[mid])
        if got is None:
            low = mid + 1
        else:
            high, best = mid, (values[mid], got)
    return best


def _prediction(r: CandidateResult) -> dict[str, float]:
    res = r.result
    assert res is not None
    out = {
        "preemptionsPerSecond": res.preemptions_per_s,
        "maxPreemptionsPerSecond": r.max_preemption_rate,
        "kvCacheUsage": res.summary()["kv_usage_mean"],
        "ttftP99Seconds": res.ttft(0.99),
        "itlP99Seconds": res.itl(0.99),
        "outputTokensPerSecond": res.output_tokens_per_s * r.candidate.replicas,
        "numGpuBlocks": r.num_gpu_blocks,
    }
    return {k: round(v, 4) for k, v in out.items() if math.isfinite(v)}


def _predicted_served_tokens_per_s(r: CandidateResult, workload: Workload) -> float:
    """What the simulation served over the span the recording measured served tokens on (its
    start to its end, idle stretches included, as :func:`_served_tokens_per_s` counts them): the
    output tokens generated by the recording's end, service-wide, over its duration. The
    simulation's own rate runs from the first arrival to the last answer, which leaves out a quiet
    tail the recording has."""
    res = r.result
    assert res is not None
    if workload.duration_s <= 0:
        return res.output_tokens_per_s * r.candidate.replicas
    end = workload.duration_s - res.start_s  # the recording's end on the simulation's clock
    tokens = max((s.num_output_tokens for s in res.samples if s.time <= end), default=0)
    return tokens * r.candidate.replicas / workload.duration_s


def _served_tokens_per_s(scrapes: Sequence[PlanScrape]) -> float | None:
    """Output tokens per second the pods served, service-wide (the counters' increases)."""
    intervals = [i for i in intervals_of(scrapes) if m.GENERATION_TOKENS_TOTAL in i.counters]
    if not intervals:
        return None
    by_pod: dict[tuple[int, str], tuple[float, float, float]] = {}
    for i in intervals:
        start, end, tokens = by_pod.get(i.key, (i.start, i.end, 0.0))
        by_pod[i.key] = (min(start, i.start), max(end, i.end), tokens + i.counters[m.GENERATION_TOKENS_TOTAL])
    span = max(e for _, e, _ in by_pod.values()) - min(s for s, _, _ in by_pod.values())
    return sum(t for _, _, t in by_pod.values()) / span if span > 0 else None


def plan_storm(
    settings: Settings, scrapes: Sequence[PlanScrape], question: PlanQuestion, seed: int = 0
) -> PlanVerdict:
    """The verdict on ``question`` for the InferenceService ``settings`` (valid) from ``scrapes``
    (those of the settings in force). Never raises for well-formed inputs."""
    plan = settings.remediation.plan
    try:
        workload = workload_from_scrapes(scrapes)
        step_time = workload.step_time()
    except (RecordingError, StepTimeError) as exc:
        return PlanVerdict(None, f"the traffic since the last change cannot be simulated: {exc}")
    if workload.num_requests < plan.min_requests:
        return PlanVerdict(
            None,
            f"too little traffic since the last change: {workload.num_requests} requests "
            f"(plan.minRequests {plan.min_requests})",
        )
    ctx, in_force = calibrate(context_of(settings, workload), workload, step_time, seed)
    if in_force.result is None:
        return PlanVerdict(None, f"the settings in force cannot be simulated: {in_force.error}")
    served = _served_tokens_per_s(scrapes)
    predicted = _prediction(in_force)
    check = {
        "predictedOutputTokensPerSecond": round(_predicted_served_tokens_per_s(in_force, workload), 4),
        "predictedMaxPreemptionsPerSecond": predicted.get("maxPreemptionsPerSecond", 0.0),
        "recordedPreemptionsPerSecond": round(workload.preemptions_per_s, 4),
        "requests": workload.num_requests,
        "seconds": round(workload.duration_s, 1),
    }
    if served is None or served <= 0:
        return PlanVerdict(None, "the pods report no output tokens to check the prediction against", check)
    check["recordedOutputTokensPerSecond"] = round(served, 4)
    error = abs(check["predictedOutputTokensPerSecond"] - served) / served
    check["outputTokensError"] = round(error, 4)
    if error > plan.max_prediction_error:
        return PlanVerdict(
            None,
            f"the settings in force are mispredicted: {check['predictedOutputTokensPerSecond']:.0f} output "
            f"tok/s predicted, {served:.0f} served ({error:.0%} off, plan.maxPredictionError "
            f"{plan.max_prediction_error:.0%})",
            check,
        )
    if in_force.sustained_preemption != question.storm:
        said = "a storm" if in_force.sustained_preemption else "no storm"
        seen = "a storm" if question.storm else "none"
        return PlanVerdict(
            None,
            f"the settings in force are mispredicted: the simulation shows {said} "
            f"({in_force.max_preemption_rate:.2g} preemptions/s at worst), the window {seen}",
            check,
        )
    base = ctx.current
    for field, value in question.base.items():
        base = dataclasses.replace(base, **{_FIELD_OF[field]: type(getattr(base, _FIELD_OF[field]))(value)})
    target = TARGET_RATIO * ctx.preemption_rate
    tried = []
    for field in question.levers:
        if field not in _FIELD_OF:
            continue

        def ends_storm(value: float | int, field: str = field) -> CandidateResult | None:
            candidate = dataclasses.replace(base, **{_FIELD_OF[field]: value})
            r = evaluate(candidate, ctx, workload, step_time, seed, kv_headroom=KV_HEADROOM)
            ok = r.result is not None and r.keeps_up and r.max_preemption_rate <= target
            return r if ok else None

        found = smallest_sufficient(lever_values(field, ctx, base), ends_storm)
        if found is None:
            tried.append(field)
            continue
        value, _ = found
        # What it predicts on the pool it will have (the search ran on one KV_HEADROOM smaller).
        r = evaluate(dataclasses.replace(base, **{_FIELD_OF[field]: value}), ctx, workload, step_time, seed)
        if r.result is None:
            tried.append(field)
            continue
        prediction = _prediction(r)
        frm = getattr(ctx.current, _FIELD_OF[field])
        reason = (
            f"planned on {workload.num_requests} requests over {workload.duration_s:.0f}s (in force "
            f"predicted at {check['predictedOutputTokensPerSecond']:.0f} output tok/s, served "
            f"{served:.0f}): {field} {frm:g} → {value:g} predicts {describe_prediction(prediction)}"
        )
        return PlanVerdict(PlannedChange(field, frm, value, prediction), reason, check)
    return PlanVerdict(
        None,
        f"no single change of {', '.join(tried) or 'an allowed lever'} within the limits keeps the "
        f"simulated preemption under {target:g}/s",
        check,
    )


class ScrapeHistory:
    """The scrapes of each pod over the last ``lookback_s`` seconds, for the planner.

    ``eager``: parse each scrape as it is added (the operator: only the small parsed form is kept), or
    keep the body and parse it when a plan asks (``kvpilot replay``: most scrapes are never planned
    on). A body the plan cannot read (invalid samples, as ``recording.parse_plan_scrape`` refuses)
    is left out; the policy's own data checks decide whether to act at all.
    """

    def __init__(self, lookback_s: float, eager: bool = True) -> None:
        self.lookback_s = lookback_s
        self.eager = eager
        self._pods: dict[str, deque[list]] = {}

    def add(self, key: str, pod: str, time: float, metrics: object) -> None:
        entries = self._pods.setdefault(key, deque())
        if entries and time <= entries[-1][0]:
            return
        entry = [time, pod, metrics, None]
        if self.eager:
            self._parse(entry)
        entries.append(entry)
        while entries and entries[0][0] < time - self.lookback_s:
            entries.popleft()

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the pods not in ``keep`` (gone)."""
        keep = set(keep)
        for key in [k for k in self._pods if k not in keep]:
            del self._pods[key]

    @staticmethod
    def _parse(entry: list) -> PlanScrape | None:
        if entry[2] is not None:
            record = Record(time=entry[0], pod=entry[1], tick=entry[0], metrics=entry[2])
            try:
                entry[3] = parse_plan_scrape(record)
            except RecordingError:
                entry[3] = None
            entry[2] = None
        return entry[3]

    def scrapes(self, keys: Iterable[str], since: float, until: float) -> list[PlanScrape]:
        """The readable scrapes of the pods ``keys`` after ``since`` and at most ``until``, within the
        lookback of ``until``."""
        start = max(since, until - self.lookback_s)
        out = []
        for key in keys:
            for entry in self._pods.get(key, ()):
                if start < entry[0] <= until:
                    scrape = self._parse(entry)
                    if scrape is not None:
                        out.append(scrape)
        return out


def planner_for(
    settings: Settings,
    scrapes: Sequence[PlanScrape] | Callable[[], Sequence[PlanScrape]],
    seed: int = 0,
) -> Planner:
    """The policy's planner for ``settings`` on ``scrapes`` (or a function giving them, called only
    when a plan is asked for); a question asked twice is answered once."""
    answers: dict[PlanQuestion, PlanVerdict] = {}

    def planner(question: PlanQuestion) -> PlanVerdict:
        key = dataclasses.replace(question, base=tuple(sorted(question.base.items())))  # hashable
        if key not in answers:
            kept = scrapes() if callable(scrapes) else scrapes
            answers[key] = plan_storm(settings, kept, question, seed)
        return answers[key]

    return planner
