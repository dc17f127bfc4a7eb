"""Seconds per candidate of ``kvpilot plan`` on ten minutes of recorded traffic, on one core.

The traffic is the recorded vLLM storm (``tests/operator/fixtures/vllm-0.32-cpu-storm.jsonl.gz``:
calm, storm, calm again, ~52 s) repeated back to back until it covers ``--minutes`` of arrivals,
with the step-time model fitted on the recording. Every candidate of the plan's grid for the
InferenceService the storm was recorded under is simulated; the table gives each one's wall time
(the process pinned to one CPU), steps, arrivals and preemptions. Goal: under 5 s per candidate.

    python benchmarks/plan_speed.py                   # 10 minutes; JSON to results/plan_speed.json
    python benchmarks/plan_speed.py --minutes 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

try:
    from tests.operator.test_plan_cli import FIXTURE, isvc
except ImportError:  # run as a script: put the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.operator.test_plan_cli import FIXTURE, isvc

from kvpilot.operator.api.settings import resolve
from kvpilot.operator.plan.candidates import candidate_grid, context_of, evaluate
from kvpilot.operator.plan.recording import read_recording
from kvpilot.operator.plan.workload import Workload, workload_from_scrapes

RESULTS = Path(__file__).resolve().parent / "results"
GOAL_S = 5.0


def tiled(workload: Workload, seconds: float) -> Workload:
    """``workload``'s arrival windows repeated back to back until they span ``seconds``."""
    period = workload.duration_s
    copies = max(1, int(-(-seconds // period)))
    windows = tuple(
        dataclasses.replace(w, start=w.start + i * period)
        for i in range(copies)
        for w in workload.windows
        if w.start + i * period < seconds
    )
    return dataclasses.replace(workload, windows=windows, duration_s=min(seconds, copies * period))


def pin_to_one_core() -> int | None:
    """Pin this process to the first CPU it may use; that CPU, or None where affinity is unsupported."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpu = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    return cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="minutes of traffic (default 10)")
    parser.add_argument("--out", type=Path, default=RESULTS / "plan_speed.json")
    args = parser.parse_args(argv)
    cpu = pin_to_one_core()
    doc = isvc()
    t0 = time.perf_counter()
    recorded = workload_from_scrapes(read_recording(FIXTURE, doc))
    step_time = recorded.step_time()
    read_s = time.perf_counter() - t0
    workload = tiled(recorded, args.minutes * 60)
    ctx = context_of(resolve(doc), workload)
    rows = []
    print(
        f"{workload.num_requests} arrivals over {workload.duration_s:.0f}s; recording read in {read_s:.2f}s"
    )
    print(f"{'CANDIDATE':40} {'SECONDS':>8} {'STEPS':>8} {'ARRIVALS':>8} {'PREEMPT':>8}")
    for candidate in candidate_grid(ctx):
        start = time.perf_counter()
        result = evaluate(candidate, ctx, workload, step_time)
        elapsed = time.perf_counter() - start
        assert result.result is not None, result.error
        row = {
            "candidate": candidate.label(ctx.current),
            "seconds": elapsed,
            "num_steps": result.result.num_steps,
            "num_arrivals": result.result.num_arrivals,
            "num_preemptions": result.result.num_preemptions,
        }
        rows.append(row)
        print(
            f"{row['candidate']:40} {elapsed:8.2f} {row['num_steps']:8d} {row['num_arrivals']:8d} "
            f"{row['num_preemptions']:8d}"
        )
    worst = max(r["seconds"] for r in rows)
    mean = sum(r["seconds"] for r in rows) / len(rows)
    print(f"per candidate: mean {mean:.2f}s, max {worst:.2f}s (goal < {GOAL_S:g}s)")
    report = {
        "minutes_of_traffic": workload.duration_s / 60,
        "num_arrivals": workload.num_requests,
        "recording_read_s": read_s,
        "pinned_cpu": cpu,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "candidates": rows,
        "mean_s_per_candidate": mean,
        "max_s_per_candidate": worst,
        "goal_s_per_candidate": GOAL_S,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
