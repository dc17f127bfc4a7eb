"""What the simulation of the settings in force is tuned on before any candidate runs: the shared
prefix that gives the recorded prefix-cache hits (``calibrate_prefix``), then the per-request TTFT the
scheduler's clock does not see (``calibrate_ttft``). ``calibrate`` does both; every candidate is then
evaluated in the context it returns (torch-free, like the rest of the plan)."""

from __future__ import annotations

import dataclasses

from kvpilot.operator.plan.candidates import CandidateResult, PlanContext, evaluate
from kvpilot.operator.plan.simulate import StepTime
from kvpilot.operator.plan.workload import Workload

# calibrate_prefix: at most this many simulations of the settings in force besides the first,
# stopping within this much of the recorded hit rate.
PREFIX_ROUNDS = 3
PREFIX_TOLERANCE = 0.02


def _hit_rate_of(prompts: list[int], shared: int, block_size: int) -> float:
    """The share of prompt tokens a cache holding ``shared`` tokens of every prompt's prefix finds: all
    but the last token of a prompt are looked up, in whole blocks."""
    total = sum(prompts)
    found = sum(min(shared, p - 1) // block_size * block_size for p in prompts)
    return found / total if total else 0.0


def _prefix_for(prompts: list[int], rate: float, block_size: int) -> int:
    """The shortest shared prefix (tokens) whose hit rate over ``prompts`` reaches ``rate`` (the
    longest prompt's when none does); the rate grows with the prefix, so bisect."""
    low, high = 0, max(prompts, default=1)
    if _hit_rate_of(prompts, high, block_size) < rate:
        return high
    while low < high:
        mid = (low + high) // 2
        if _hit_rate_of(prompts, mid, block_size) >= rate:
            high = mid
        else:
            low = mid + 1
    return low


def calibrate_prefix(
    ctx: PlanContext, workload: Workload, step_time: StepTime, seed: int = 0
) -> tuple[PlanContext, CandidateResult | None]:
    """The context with ``shared_prefix_len`` set from the recorded prefix-cache hit rate, and the
    settings in force evaluated in it (None when the recording shows no hit to model).

    Prompts drawn from the histograms are all distinct: in simulation only a recompute finds its own
    blocks again. The recording says what share of prompt tokens the cache held. First the settings
    in force are simulated as they are; where their hits fall short of the recorded rate by more
    than ``PREFIX_TOLERANCE``, every drawn prompt is given a prefix shared with the others (a system
    prompt, say) of the length whose hits make up the difference over the drawn prompt lengths (in
    whole blocks, all but a prompt's last token), then corrected against the simulation (what the
    pool evicts, what recomputes add) for at most ``PREFIX_ROUNDS`` simulations. The length whose
    simulated rate came closest is kept. A trace carries each request's own hits: it is left as it is.
    """
    rate = workload.prefix_hit_rate
    if not ctx.enable_prefix_caching or workload.trace is not None or not rate or rate <= 0:
        return ctx, None
    baseline = evaluate(ctx.current, ctx, workload, step_time, seed)
    if baseline.result is None or baseline.result.prefix_hit_rate is None:
        return ctx, baseline
    own = baseline.result.prefix_hit_rate
    best = (abs(own - rate), 0, baseline)
    prompts = [a.prompt_len for a in workload.arrivals(seed)]
    target = rate - own
    for _ in range(PREFIX_ROUNDS):
        if best[0] <= PREFIX_TOLERANCE:
            break
        shared = _prefix_for(prompts, min(1.0, max(0.0, target)), ctx.block_size)
        if shared <= 0 or shared == best[1]:
            break
        trial = evaluate(
            ctx.current, dataclasses.replace(ctx, shared_prefix_len=shared), workload, step_time, seed
        )
        simulated = trial.result.prefix_hit_rate if trial.result is not None else None
        if simulated is None:
            break
        if abs(simulated - rate) < best[0]:
            best = (abs(simulated - rate), shared, trial)
        target += rate - simulated
    _, shared, in_force = best
    if shared <= 0:
        return ctx, baseline
    simulated = in_force.result.prefix_hit_rate if in_force.result is not None else None
    note = (
        f"prefix cache: the recorded hit rate {rate:.0%} given as a prefix of {shared} tokens every drawn "
        f"prompt shares"
        + (f" ({simulated:.0%} simulated for the settings in force)" if simulated is not None else "")
    )
    return dataclasses.replace(ctx, shared_prefix_len=shared, notes=(*ctx.notes, note)), in_force


def calibrate(
    ctx: PlanContext, workload: Workload, step_time: StepTime, seed: int = 0
) -> tuple[PlanContext, CandidateResult]:
    """``calibrate_prefix`` then ``calibrate_ttft``: the context every candidate is evaluated in, and
    the settings in force evaluated under it."""
    ctx, in_force = calibrate_prefix(ctx, workload, step_time, seed)
    return calibrate_ttft(ctx, workload, step_time, seed, in_force)


def calibrate_ttft(
    ctx: PlanContext,
    workload: Workload,
    step_time: StepTime,
    seed: int = 0,
    in_force: CandidateResult | None = None,
) -> tuple[PlanContext, CandidateResult]:
    """The context with ``ttft_overhead_s`` set, and the settings in force evaluated under it.

    The engine measures TTFT from a request's arrival at its front end; the simulated clock starts
    when the request reaches the scheduler and stops at the end of the step that samples its first
    token. What lies outside -- handing the request to the engine loop, the loop's share of the
    interpreter with the server's event loop, turning the token into an output -- is a per-request
    cost the step time does not hold. It is taken as the recorded mean TTFT less the simulated mean
    for the settings in force (never below 0: a simulation slower than the recording is left as it
    is), and added to every candidate's TTFTs. ``in_force``: the settings in force already evaluated
    in ``ctx`` (None: evaluated here)."""
    if in_force is None:
        in_force = evaluate(ctx.current, ctx, workload, step_time, seed)
    recorded = workload.ttft_mean_s
    if recorded is None or in_force.result is None or not in_force.result.ttft_s:
        return ctx, in_force
    simulated = sum(in_force.result.ttft_s) / len(in_force.result.ttft_s)
    overhead = max(0.0, recorded - simulated)
    if overhead <= 0:
        return ctx, in_force
    note = (
        f"TTFT: {overhead * 1e3:.1f} ms per request added to the simulated scheduler's (the recorded mean "
        f"{recorded * 1e3:.1f} ms less the simulated {simulated * 1e3:.1f} ms of the settings in force)"
    )
    calibrated = dataclasses.replace(ctx, ttft_overhead_s=overhead, notes=(*ctx.notes, note))
    return calibrated, evaluate(ctx.current, calibrated, workload, step_time, seed)
