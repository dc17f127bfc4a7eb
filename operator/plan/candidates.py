"""The settings in force and a small grid of candidates within ``spec.remediation.limits``, each run
through the simulator on the recorded workload; the cheapest one without sustained preemption.

Candidates vary the levers the remediation policy moves: ``gpuMemoryUtilization`` (up to
``maxGpuMemoryUtilization``; the KV pool scales as ``workload.KVPool.blocks_at`` says),
``maxNumSeqs`` and ``maxNumBatchedTokens`` (down to their floors) and ``replicas`` (up to
``maxReplicas``). The grid is each lever alone, then the highest memory fraction with each replica
count -- small on purpose (one simulation per candidate), not an exhaustive search.

Replicas: the recorded arrivals (service-wide) are dealt round-robin, and one replica -- the first,
which gets the most when they do not divide evenly -- is simulated, its in-flight requests capped at
its share of the clients' concurrency (``workload``); throughput is that replica's times the
replica count. Where the recorded queue never emptied (``workload.Workload.saturated``) the requests
are replayed closed-loop: all ready at the start, each sent as soon as the cap allows.

"Sustained preemption" here: over some ``spec.remediation.window`` of the simulated run, a replica
preempts at more than ``spec.remediation.preemptionRate`` per second (the policy's storm threshold).
With ``spec.remediation.slo.ttftP99Seconds`` a candidate must also be predicted within it.
A candidate that leaves requests unfinished when the simulation stops (twice the recording's
length) cannot keep up and is never picked. Cost: GPUs (replicas x GPUs per replica), then the
number of levers changed, then the predicted TTFT p99.

TTFT and ITL quantiles rest on at least ``MIN_LATENCY_SAMPLES`` requests: a short recording's
workload is drawn again with the following seeds (other arrival times within each interval, other
lengths; at most ``MAX_REALIZATIONS`` draws in all) and the latencies of every draw pooled. A p99 of
two hundred requests is their second slowest, which one draw puts anywhere from the median's double
to its ten-fold where queues form rarely; the p99 of the pooled draws is the workload's, not one
draw's. Every other prediction (preemptions, throughput, the timeline) is the first draw's. A trace
replays the same requests every time, so it is drawn once. Where the p99 sits at a knee (a queue that
forms only when a few requests overlap) even a thousand requests' p99 moves by a third from one draw
to the next; ``PlanContext.latency_samples`` (``kvpilot plan --latency-samples``) pools more draws
for an offline plan that has the time (each draw is a whole simulation).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

from kvpilot.operator.api.settings import Settings
from kvpilot.operator.api.spec import ENGINE_KEYS
from kvpilot.operator.plan.handling import HandlingTime, ScrapeTurns
from kvpilot.operator.plan.simulate import (
    Arrival,
    EngineSettings,
    SimResult,
    SimulationError,
    StepTime,
    simulate,
)
from kvpilot.operator.plan.workload import Workload

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192  # the engine's default (EngineArgs.max_num_batched_tokens)
LEVERS = ("gpuMemoryUtilization", "maxNumSeqs", "maxNumBatchedTokens", "replicas")
# The latency quantiles pool draws of the workload until they hold this many requests (10 beyond a
# p99), drawing it at most MAX_REALIZATIONS times in all.
MIN_LATENCY_SAMPLES = 1000
MAX_REALIZATIONS = 8


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One setting of the levers (``spec.engine`` names and ``replicas``)."""

    gpu_memory_utilization: float
    max_num_seqs: int
    max_num_batched_tokens: int
    replicas: int

    def as_dict(self) -> dict[str, float | int]:
        return {
            "gpuMemoryUtilization": self.gpu_memory_utilization,
            "maxNumSeqs": self.max_num_seqs,
            "maxNumBatchedTokens": self.max_num_batched_tokens,
            "replicas": self.replicas,
        }

    def changes(self, current: Candidate) -> dict[str, tuple[float | int, float | int]]:
        """lever -> (in force, this candidate's) for each lever that differs from ``current``."""
        mine, theirs = self.as_dict(), current.as_dict()
        return {k: (theirs[k], mine[k]) for k in LEVERS if mine[k] != theirs[k]}

    def label(self, current: Candidate) -> str:
        changes = self.changes(current)
        if not changes:
            return "in force"
        return ", ".join(f"{k} {_fmt(v)}" for k, (_, v) in changes.items())


def _fmt(value: float | int) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclasses.dataclass(frozen=True)
class PlanContext:
    """What every candidate shares: the engine settings in force besides the levers, the remediation
    bounds, and what the simulation runs on."""

    current: Candidate
    block_size: int
    max_model_len: int
    enable_chunked_prefill: bool
    enable_prefix_caching: bool
    preemption_mode: str
    num_cpu_blocks: int
    gpus_per_replica: int
    preemption_rate: float
    window_s: float
    limits: Any  # api.settings.Limits
    notes: tuple[str, ...] = ()
    # The clients' concurrency, service-wide (workload.peak_in_flight); None: open loop.
    client_concurrency: int | None = None
    # The recorded queue never emptied (workload.saturated): requests are replayed closed-loop, each
    # sent as soon as the client-concurrency cap allows, instead of at their recorded times.
    closed_loop: bool = False
    # With closed_loop: a client's time from a request's end to its next request reaching the engine
    # (workload.client_turnaround_s).
    client_turnaround_s: float = 0.0
    # The server's time on each request before it reaches the engine, one request at a time on the
    # engine's interpreter (workload.handling_time: the timed intakes, else the short arrival gaps;
    # None: none, a burst reaches the engine at once).
    handling: HandlingTime | None = None
    # The server's turns on the /metrics scrapes (handling.scrape_turns_of; None: none modelled).
    scrapes: ScrapeTurns | None = None
    # spec.remediation.slo.ttftP99Seconds: a candidate predicted above it is not picked (None: no SLO).
    ttft_slo_s: float | None = None
    # Added to every simulated TTFT: the part of the engine's measured TTFT the scheduler's clock does
    # not see (calibrate.calibrate_ttft).
    ttft_overhead_s: float = 0.0
    # The prefix every drawn prompt shares, in tokens: the recorded prefix-cache hits
    # (calibrate.calibrate_prefix).
    shared_prefix_len: int = 0
    # The requests the latency quantiles rest on at least (see the module doc); the draws stop at
    # MAX_REALIZATIONS per MIN_LATENCY_SAMPLES of it.
    latency_samples: int = MIN_LATENCY_SAMPLES


def context_of(settings: Settings, workload: Workload, open_loop: bool = False) -> PlanContext:
    """The plan's context from a resolved, valid InferenceService and its recorded workload;
    ``open_loop`` drops the client-concurrency cap (see ``workload``)."""
    effective = settings.effective
    assert effective is not None, "resolve() gave problems; check Settings.is_valid first"
    engine = effective.engine

    def value(key: str) -> Any:
        return engine.get(key, ENGINE_KEYS[key].default)

    notes = []
    pool = workload.pool
    fraction = float(value("gpuMemoryUtilization"))
    if pool.gpu_memory_utilization is not None and not math.isclose(fraction, pool.gpu_memory_utilization):
        notes.append(
            f"the recording's pool was sized at gpuMemoryUtilization {pool.gpu_memory_utilization:g}, "
            f"the spec says {fraction:g}: the recorded fraction is taken as in force"
        )
        fraction = pool.gpu_memory_utilization
    block_size = int(value("blockSize"))
    if block_size != pool.block_size:
        notes.append(f"block size {pool.block_size} from the recording (the spec says {block_size})")
    batched = value("maxNumBatchedTokens")
    max_model_len = value("maxModelLen")
    if max_model_len is None:
        max_model_len = pool.num_gpu_blocks * pool.block_size
        notes.append(f"maxModelLen unset: taken as the KV pool's {max_model_len} tokens")
    if batched is None:
        batched = DEFAULT_MAX_NUM_BATCHED_TOKENS
        notes.append(
            f"maxNumBatchedTokens unset: kvpilot's engine default {batched} is taken as in force "
            "(set spec.engine.maxNumBatchedTokens where the runtime's default differs)"
        )
    rem = settings.remediation
    closed_loop = not open_loop and workload.peak_in_flight is not None and workload.saturated
    handling = workload.handling_time
    # The turnaround Little's law gives holds the server's handling, which the simulation adds itself.
    turnaround = workload.client_turnaround_s - (handling.mean_s if handling is not None else 0.0)
    return PlanContext(
        current=Candidate(fraction, int(value("maxNumSeqs")), int(batched), int(effective.replicas)),
        block_size=pool.block_size,
        max_model_len=int(max_model_len),
        enable_chunked_prefill=bool(value("enableChunkedPrefill")),
        enable_prefix_caching=pool.enable_prefix_caching,
        preemption_mode=str(value("preemptionMode")),
        num_cpu_blocks=pool.num_cpu_blocks,
        gpus_per_replica=rem.gpus_per_replica,
        preemption_rate=rem.preemption_rate,
        window_s=rem.window_s,
        limits=rem.limits,
        notes=tuple(notes),
        client_concurrency=None if open_loop else workload.peak_in_flight,
        closed_loop=closed_loop,
        client_turnaround_s=max(0.0, turnaround) if closed_loop else 0.0,
        handling=handling,
        scrapes=workload.scrape_turns,
        ttft_slo_s=rem.ttft_p99_slo_s,
    )


def candidate_grid(ctx: PlanContext, can_resize_pool: bool = True) -> list[Candidate]:
    """The settings in force first, then each lever alone, then the highest memory fraction with
    each replica count; all within the limits, without duplicates."""
    cur, lim = ctx.current, ctx.limits
    fractions = [cur.gpu_memory_utilization]
    if can_resize_pool and lim.max_gpu_memory_utilization > cur.gpu_memory_utilization:
        top = lim.max_gpu_memory_utilization
        fractions += [round((cur.gpu_memory_utilization + top) / 2, 3), top]
    seqs = sorted(
        {max(lim.min_max_num_seqs, v) for v in (cur.max_num_seqs // 2, lim.min_max_num_seqs)}, reverse=True
    )
    seqs = [s for s in seqs if s < cur.max_num_seqs]
    half = max(lim.min_max_num_batched_tokens, cur.max_num_batched_tokens // 2)
    # Without chunked prefill a step must hold a whole prompt: the budget stays >= max_model_len.
    floor = 1 if ctx.enable_chunked_prefill else ctx.max_model_len
    batched = [half] if floor <= half < cur.max_num_batched_tokens else []
    low, high = max(lim.min_replicas, 1), lim.max_replicas
    replica_counts = sorted(
        {r for r in (cur.replicas + 1, cur.replicas * 2, high) if cur.replicas < r <= high}
    )
    if cur.replicas > low:
        replica_counts.insert(0, cur.replicas - 1)
    out = [cur]
    out += [dataclasses.replace(cur, gpu_memory_utilization=f) for f in fractions[1:]]
    out += [dataclasses.replace(cur, max_num_seqs=s) for s in seqs]
    out += [dataclasses.replace(cur, max_num_batched_tokens=b) for b in batched]
    out += [dataclasses.replace(cur, replicas=r) for r in replica_counts]
    out += [
        dataclasses.replace(cur, gpu_memory_utilization=fractions[-1], replicas=r) for r in replica_counts
    ]
    unique: list[Candidate] = []
    for c in out:
        if c not in unique:
            unique.append(c)
    return unique


@dataclasses.dataclass(frozen=True)
class CandidateResult:
    """One candidate's predictions (one replica's run; throughput service-wide)."""

    candidate: Candidate
    is_current: bool
    num_gpu_blocks: int
    num_gpus: int
    result: SimResult | None
    max_preemption_rate: float  # per replica, per second, over the worst remediation window
    sustained_preemption: bool
    keeps_up: bool
    error: str | None = None
    meets_slo: bool = True  # its predicted TTFT p99 is within spec.remediation.slo (or there is none)

    @property
    def eligible(self) -> bool:
        return self.result is not None and self.keeps_up and not self.sustained_preemption and self.meets_slo

    def as_dict(self, current: Candidate) -> dict[str, Any]:
        summary = self.result.summary() if self.result is not None else {}
        if self.result is not None:
            summary["output_tokens_per_s"] = self.result.output_tokens_per_s * self.candidate.replicas
        return {
            "candidate": self.candidate.as_dict(),
            "label": self.candidate.label(current),
            "in_force": self.is_current,
            "num_gpu_blocks": self.num_gpu_blocks,
            "num_gpus": self.num_gpus,
            "max_preemption_rate": self.max_preemption_rate,
            "sustained_preemption": self.sustained_preemption,
            "keeps_up": self.keeps_up,
            "meets_slo": self.meets_slo,
            "error": self.error,
            "per_replica": summary,
            "timeline": self.result.timeline() if self.result is not None else [],
        }


def evaluate(
    candidate: Candidate,
    ctx: PlanContext,
    workload: Workload,
    step_time: StepTime,
    seed: int = 0,
    kv_headroom: float = 0.0,
) -> CandidateResult:
    """Simulate one replica of ``candidate`` on the workload (see the module doc); ``kv_headroom``: run
    it on a KV pool this fraction smaller than the candidate's (a margin for what the recorded
    distributions cannot show)."""
    blocks = workload.pool.blocks_at(
        candidate.gpu_memory_utilization, candidate.max_num_seqs, candidate.max_num_batched_tokens
    )
    if kv_headroom > 0:
        blocks = max(1, math.floor(blocks * (1.0 - kv_headroom)))
    gpus = candidate.replicas * ctx.gpus_per_replica
    settings = EngineSettings(
        num_gpu_blocks=blocks,
        block_size=ctx.block_size,
        max_num_seqs=candidate.max_num_seqs,
        max_num_batched_tokens=candidate.max_num_batched_tokens,
        max_model_len=ctx.max_model_len,
        enable_chunked_prefill=ctx.enable_chunked_prefill,
        enable_prefix_caching=ctx.enable_prefix_caching,
        preemption_mode=ctx.preemption_mode,
        num_cpu_blocks=ctx.num_cpu_blocks,
    )
    limit = min(ctx.max_model_len - 1, blocks * ctx.block_size - 1)
    cap = None
    if ctx.client_concurrency is not None:
        cap = max(1, -(-ctx.client_concurrency // candidate.replicas))  # this replica's share

    def run(draw: int) -> SimResult:
        arrivals = [
            with_prefix(a, min(a.prompt_len, limit), ctx.shared_prefix_len)
            for a in workload.arrivals(draw)[:: candidate.replicas]
        ]
        if cap is not None and ctx.closed_loop and arrivals:
            # Every request ready from the start, in the recorded order: the cap sends each one as
            # soon as another finishes (the clients of a queue that never emptied).
            arrivals = [dataclasses.replace(a, time=arrivals[0].time) for a in arrivals]
        return simulate(
            settings,
            arrivals,
            step_time,
            max_sim_s=2 * max(workload.duration_s, 1.0),
            max_in_flight=cap,
            client_turnaround_s=ctx.client_turnaround_s,
            handling=ctx.handling.draw if ctx.handling is not None else None,
            scrapes=(ctx.scrapes.period_s, ctx.scrapes.render.draw) if ctx.scrapes is not None else None,
            scrape_times=workload.scrape_times if workload.trace is not None else (),
            stamped=workload.trace is not None,
            seed=draw,
        )

    try:
        result = run(seed)
        ttft, itl = list(result.ttft_s), list(result.itl_s)
        draws = 1 if workload.trace is not None else max_realizations(ctx.latency_samples)
        for draw in range(seed + 1, seed + draws):
            if len(ttft) >= ctx.latency_samples:
                break
            more = run(draw)
            ttft += more.ttft_s
            itl += more.itl_s
    except SimulationError as exc:
        return CandidateResult(
            candidate, candidate == ctx.current, blocks, gpus, None, math.nan, True, False, str(exc)
        )
    result = dataclasses.replace(
        result, ttft_s=tuple(t + ctx.ttft_overhead_s for t in ttft), itl_s=tuple(itl)
    )
    rate = result.max_preemption_rate(ctx.window_s)
    ttft_p99 = result.ttft(0.99)
    return CandidateResult(
        candidate,
        candidate == ctx.current,
        blocks,
        gpus,
        result,
        rate,
        sustained_preemption=rate > ctx.preemption_rate,
        keeps_up=not result.truncated,
        meets_slo=ctx.ttft_slo_s is None or not ttft_p99 > ctx.ttft_slo_s,
    )


def max_realizations(latency_samples: int) -> int:
    """The most draws of a workload pooled for ``latency_samples`` requests: MAX_REALIZATIONS per
    MIN_LATENCY_SAMPLES (a recording of a few requests is not drawn without end)."""
    return MAX_REALIZATIONS * max(1, -(-latency_samples // MIN_LATENCY_SAMPLES))


def with_prefix(arrival: Arrival, prompt_len: int, shared: int) -> Arrival:
    """``arrival`` with its prompt cut to ``prompt_len``; one without a prefix of its own (drawn from
    the histograms) starts with the ``shared`` tokens every such prompt shares (group 0, as the trace's
    prefixes), up to all but its last token."""
    if arrival.prefix_group is None and shared > 0:
        keep = min(shared, prompt_len - 1)
        return dataclasses.replace(
            arrival, prompt_len=prompt_len, prefix_group=0 if keep else None, prefix_len=keep
        )
    keep = min(arrival.prefix_len, prompt_len - 1)
    return dataclasses.replace(arrival, prompt_len=prompt_len, prefix_len=keep)


def run_plan(
    ctx: PlanContext,
    workload: Workload,
    step_time: StepTime,
    candidates: list[Candidate],
    seed: int = 0,
    progress: Callable[[Iterator[Candidate]], Iterator[Candidate]] | None = None,
) -> list[CandidateResult]:
    """Every candidate evaluated, in order; ``progress`` wraps the iteration (a progress bar)."""
    items: Iterator[Candidate] = iter(candidates)
    if progress is not None:
        items = progress(items)
    return [evaluate(c, ctx, workload, step_time, seed) for c in items]


def pick(results: list[CandidateResult], current: Candidate) -> CandidateResult | None:
    """The cheapest eligible result (see the module doc), None when no candidate is eligible."""
    eligible = [r for r in results if r.eligible]
    if not eligible:
        return None
    return min(
        eligible,
        key=lambda r: (r.num_gpus, len(r.candidate.changes(current)), _or_inf(r.result.ttft(0.99))),
    )


def _or_inf(value: float) -> float:
    return math.inf if math.isnan(value) else value
