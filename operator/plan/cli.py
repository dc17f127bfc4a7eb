"""``kvpilot plan -f inferenceservice.yaml --recording rec.jsonl[.gz]``: predict what the levers do.

Reads the InferenceService (the settings in force, the remediation limits) and a recording (JSON
Lines of scrapes, as ``kvpilot operator --record`` writes them and ``kvpilot replay`` reads them;
several, of other stretches of the same settings, are laid end to end: ``recording.read_recordings``),
fits the step-time model, rebuilds the workload, simulates the settings in force and a small grid
of candidates, and prints one row per candidate; the cheapest one without sustained preemption is
marked ``*``. ``--json PATH`` writes everything as JSON too, ``--plot PATH`` a PNG of predicted vs
recorded for the settings in force and of the candidates' cost against their predicted preemption
(``plan.plot``; skipped, with a line saying so, without matplotlib). Needs no cluster, no model and no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from kvpilot.engine.server.cli import positive_int
from kvpilot.operator.plan.calibrate import calibrate
from kvpilot.operator.plan.candidates import (
    MIN_LATENCY_SAMPLES,
    Candidate,
    CandidateResult,
    PlanContext,
    candidate_grid,
    context_of,
    pick,
    run_plan,
)
from kvpilot.operator.plan.recording import PlanScrape, RecordingError, read_recordings
from kvpilot.operator.plan.step_time import LinearStepTime, StepTimeError
from kvpilot.operator.plan.trace import with_trace
from kvpilot.operator.plan.workload import Workload, workload_from_scrapes

HEADER = (
    "",
    "CANDIDATE",
    "GPUS",
    "BLOCKS",
    "PREEMPT/S",
    "PEAK/S",
    "KV USE",
    "QUEUE",
    "TTFT P50",
    "TTFT P99",
    "ITL P50",
    "ITL P99",
    "OUT TOK/S",
    "DONE",
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    plan = subparsers.add_parser(
        "plan",
        help="simulate the settings in force and candidate levers on recorded traffic",
        description="Run the engine's own scheduler and block manager on a simulated clock over the "
        "traffic a recording shows (JSON Lines of scrapes, `kvpilot operator --record`), for the "
        "settings in force and a grid of candidates within spec.remediation.limits; print the "
        "predicted preemptions, KV usage, queue, TTFT, ITL and throughput of each, and mark the "
        "cheapest candidate without sustained preemption.",
    )
    plan.add_argument("-f", "--filename", required=True, metavar="FILE", help="InferenceService manifest")
    plan.add_argument(
        "--recording",
        required=True,
        action="append",
        metavar="SAMPLES",
        help="recorded scrapes (JSON Lines, .gz allowed); repeat the flag for recordings of other "
        "stretches of the same settings, which the plan lays end to end as one longer recording",
    )
    plan.add_argument("--json", metavar="PATH", default=None, help="also write the plan as JSON to PATH")
    plan.add_argument(
        "--plot",
        metavar="PATH",
        default=None,
        help="also draw a PNG to PATH: predicted vs recorded for the settings in force, and each "
        "candidate's GPUs against its predicted preemption rate (needs matplotlib: the demo extra)",
    )
    plan.add_argument("--seed", type=int, default=0, help="seed of the arrival times and lengths drawn")
    plan.add_argument(
        "--open-loop",
        action="store_true",
        help="send every recorded arrival at its time (default: never more in flight than the "
        "recording's peak, as clients that wait for answers do)",
    )
    plan.add_argument(
        "--step-spread",
        action="store_true",
        help="draw every simulated step's time from the recorded spread of single steps "
        "(kvpilot_engine_step_time_ratio) instead of replaying the recording's slow stretches",
    )
    plan.add_argument(
        "--trace",
        action="append",
        default=[],
        metavar="FILE",
        help="a request trace (`kvpilot serve --request-trace`, one per pod; repeat the flag): the "
        "arrivals, length pairs and prefix-cache hits as recorded instead of the histograms' "
        "distributions",
    )
    plan.add_argument(
        "--latency-samples",
        type=positive_int,
        default=MIN_LATENCY_SAMPLES,
        metavar="N",
        help="pool draws of the recorded workload until the TTFT and ITL quantiles rest on N requests "
        f"(default {MIN_LATENCY_SAMPLES}; more draws cost more time, and steady a p99 at a knee, where "
        "one draw of a thousand requests moves it by a third)",
    )
    plan.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    plan.set_defaults(func=run_plan_command)


def _progress(total: int, enabled: bool):
    """A tqdm wrapper for the candidate loop when tqdm is installed and wanted, else None."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # the slim operator image: plan runs, without a bar
        return None

    def wrap(items: Iterator[Candidate]) -> Iterator[Candidate]:
        return iter(tqdm(items, total=total, desc="simulating", unit="candidate", file=sys.stderr))

    return wrap


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1e3:.1f}ms"


def format_table(results: list[CandidateResult], current: Candidate, chosen: CandidateResult | None) -> str:
    """One row per candidate, ``*`` on ``chosen``."""
    rows = [HEADER]
    for r in results:
        label = r.candidate.label(current)
        mark = "*" if r is chosen else ""
        if r.result is None:
            rows.append((mark, label, str(r.num_gpus), str(r.num_gpu_blocks), "error: " + str(r.error)))
            continue
        res = r.result
        summary = res.summary()
        rows.append(
            (
                mark,
                label,
                str(r.num_gpus),
                str(r.num_gpu_blocks),
                f"{res.preemptions_per_s:.2f}",
                f"{r.max_preemption_rate:.2f}",
                f"{summary['kv_usage_mean']:.0%}",
                f"{summary['queue_depth_mean']:.1f}",
                _ms(res.ttft(0.5)),
                _ms(res.ttft(0.99)),
                _ms(res.itl(0.5)),
                _ms(res.itl(0.99)),
                f"{res.output_tokens_per_s * r.candidate.replicas:.0f}",
                f"{res.num_finished}/{res.num_arrivals}" + ("" if r.keeps_up else " (behind)"),
            )
        )
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(len(HEADER))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)).rstrip() for row in rows
    )


def plan_document(
    isvc: dict[str, Any],
    recordings: Sequence[str],
    workload: Workload,
    step_time: LinearStepTime,
    ctx: PlanContext,
    results: list[CandidateResult],
    chosen: CandidateResult | None,
) -> dict[str, Any]:
    """Everything the table shows and more, as a JSON-ready dict."""
    meta = isvc.get("metadata") or {}

    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    return clean(
        {
            "inferenceService": {"name": meta.get("name"), "namespace": meta.get("namespace")},
            "recording": recordings[0],
            "recordings": list(recordings),
            "workload": {
                "duration_s": workload.duration_s,
                "num_requests": workload.num_requests,
                "arrival_rate": workload.arrival_rate,
                "num_pods": workload.num_pods,
                "recorded_preemptions": workload.num_preemptions,
                "recorded_preemptions_per_s_per_pod": workload.preemptions_per_s,
                "num_gpu_blocks": workload.pool.num_gpu_blocks,
                "block_size": workload.pool.block_size,
                "gpu_memory_utilization": workload.pool.gpu_memory_utilization,
            },
            "step_time": {
                "a_s": step_time.a,
                "b_s_per_token": step_time.b,
                "c_s_per_seq": step_time.c,
                "d_s_per_decode_context_token": step_time.d,
                "e_s_per_prefill_pair": step_time.e,
                "terms": list(step_time.terms),
                "num_windows": step_time.num_windows,
                "rmse_s": step_time.rmse_s,
                # How single steps spread around the model (with_jitter; 0 steps: not drawn) and the
                # recorded slow stretches replayed instead (with_variation).
                "spread_steps": step_time.jitter_steps,
                "spread_p10_p50_p90": [step_time.jitter_factor(q) for q in (0.1, 0.5, 0.9)],
                "variation_segments": len(step_time.variation),
            },
            "threshold": {"preemption_rate": ctx.preemption_rate, "window_s": ctx.window_s},
            "client_concurrency": ctx.client_concurrency,
            "closed_loop": ctx.closed_loop,
            "client_turnaround_s": ctx.client_turnaround_s,
            # The server's time on each request (handling.HandlingTime; null: none modelled).
            "handling_mean_s": ctx.handling.mean_s if ctx.handling is not None else None,
            "handling_samples": ctx.handling.samples if ctx.handling is not None else 0,
            # The server's turns on the /metrics scrapes (handling.ScrapeTurns; null: none modelled).
            "scrape_period_s": ctx.scrapes.period_s if ctx.scrapes is not None else None,
            "scrape_render_mean_s": ctx.scrapes.render.mean_s if ctx.scrapes is not None else None,
            "ttft_p99_slo_s": ctx.ttft_slo_s,
            "ttft_overhead_s": ctx.ttft_overhead_s,
            # The requests the latency quantiles rest on at least (--latency-samples).
            "latency_samples": ctx.latency_samples,
            "notes": list(ctx.notes),
            "candidates": [r.as_dict(ctx.current) for r in results],
            "pick": None if chosen is None else results.index(chosen),
        }
    )


def run_plan_command(args: argparse.Namespace) -> int:
    """``kvpilot plan``: 0 with the table on stdout, or 1 with one error line on stderr."""
    from kvpilot.operator.api.settings import resolve
    from kvpilot.operator.cli import read_one_inference_service

    isvc = read_one_inference_service(args.filename)
    if isvc is None:
        return 1
    settings = resolve(isvc)
    if not settings.is_valid:
        print("error: invalid InferenceService: " + "; ".join(settings.problems), file=sys.stderr)
        return 1
    try:
        scrapes = read_recordings(args.recording, isvc)
        workload = workload_from_scrapes(scrapes)
        if args.trace:
            workload = with_trace(workload, scrapes, args.trace)
        step_time = workload.step_time(spread=args.step_spread)
    except (RecordingError, StepTimeError) as exc:
        print(f"error: {', '.join(args.recording)}: {exc}", file=sys.stderr)
        return 1
    ctx, _ = calibrate(
        context_of(settings, workload, open_loop=args.open_loop), workload, step_time, args.seed
    )
    ctx = dataclasses.replace(ctx, latency_samples=args.latency_samples)
    candidates = candidate_grid(ctx, can_resize_pool=not workload.pool.explicit_size)
    results = run_plan(
        ctx, workload, step_time, candidates, args.seed, _progress(len(candidates), not args.no_progress)
    )
    chosen = pick(results, ctx.current)
    pool = workload.pool
    print(
        f"workload: {workload.num_requests} requests over {workload.duration_s:.0f}s "
        f"({workload.arrival_rate:.2f}/s, {workload.num_pods} pod(s)); recorded "
        f"{workload.num_preemptions:.0f} preemptions ({workload.preemptions_per_s:.2f}/s per pod); "
        f"KV pool {pool.num_gpu_blocks} blocks x {pool.block_size} "
        f"at gpuMemoryUtilization {pool.gpu_memory_utilization}"
    )
    print(f"step time: {step_time.describe()}")
    if ctx.client_concurrency is not None:
        replay = (
            "; the engine paced them: replayed closed-loop, each request sent "
            f"{ctx.client_turnaround_s * 1e3:.1f} ms after one finishes (the clients' turnaround)"
            if ctx.closed_loop
            else ""
        )
        print(
            f"clients: at most {ctx.client_concurrency} request(s) in flight (the recording's peak){replay}"
        )
    if ctx.handling is not None:
        print(f"server: one request at a time, {ctx.handling.describe()}")
    if ctx.scrapes is not None:
        at = ""
        if workload.trace is not None and workload.scrape_times:
            at = f", at the {len(workload.scrape_times)} times the recording scraped"
        print(f"server: {ctx.scrapes.describe()}{at}")
    for note in ctx.notes:
        print(f"note: {note}")
    print(format_table(results, ctx.current, chosen))
    threshold = f"{ctx.preemption_rate:g} preemptions/s per replica over {ctx.window_s:g}s"
    goal = "avoids sustained preemption"
    if ctx.ttft_slo_s is not None:
        goal += f" and keeps TTFT p99 within {ctx.ttft_slo_s * 1e3:g}ms"
    if chosen is None:
        print(f"no candidate within the limits {goal} ({threshold})")
    else:
        print(f"* cheapest that {goal} ({threshold}): {chosen.candidate.label(ctx.current)}")
    if args.json:
        document = plan_document(isvc, args.recording, workload, step_time, ctx, results, chosen)
        try:
            with open(args.json, "w", encoding="utf-8") as handle:
                json.dump(document, handle, indent=2)
                handle.write("\n")
        except OSError as exc:
            print(f"error: cannot write {args.json}: {exc}", file=sys.stderr)
            return 1
    if args.plot:
        return _write_plot(args.plot, isvc, scrapes, workload, ctx, results, chosen)
    return 0


def _write_plot(
    path: str,
    isvc: dict[str, Any],
    scrapes: list[PlanScrape],
    workload: Workload,
    ctx: PlanContext,
    results: list[CandidateResult],
    chosen: CandidateResult | None,
) -> int:
    """``--plot``: 0 with one line on stdout saying what was drawn (or, without matplotlib, one line
    on stderr saying the plot was skipped), 1 with one error line when the file cannot be written."""
    from kvpilot.operator.plan import plot

    meta = isvc.get("metadata") or {}
    title = f"kvpilot plan: {meta.get('namespace') or 'default'}/{meta.get('name')}"
    try:
        summary = plot.write_plan_plot(
            path,
            scrapes,
            results,
            chosen,
            ctx.current,
            ctx.preemption_rate,
            ctx.window_s,
            workload.num_pods,
            title=title,
        )
    except (OSError, ValueError) as exc:
        print(f"error: cannot write {path}: {exc}", file=sys.stderr)
        return 1
    if summary is None:
        print(
            f"note: plot skipped, {path} not written: matplotlib is not installed "
            "(pip install 'kvpilot[demo]')",
            file=sys.stderr,
        )
        return 0
    print(
        f"plot: {path} ({summary['num_windows']} windows predicted vs recorded, "
        f"{summary['num_points']} candidates)"
    )
    return 0
