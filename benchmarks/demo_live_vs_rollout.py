"""Storm -> relief with live levers vs the restart path, on the demo's checkpoint and load.

Runs ``make demo``'s module ``--rounds`` times each way, interleaved: with live levers (the default: a
live ``relieveMaxNumSeqs`` first, the rollout of ``raiseGpuMemoryUtilization`` after it, then
``restoreMaxNumSeqs``) and with ``--no-live`` (the rollout first). From each run's ``summary.json``:
the time from the first change (the storm detected) to relief (preemptions below the threshold for 5 s),
how the change that brought it was applied, the requests completed meanwhile, and the restart lever's
rollout time. Prints the medians side by side and writes ``benchmarks/results/demo_live_vs_rollout.json``.

    python benchmarks/demo_live_vs_rollout.py [--rounds 3] [--quick] [--model DIR]

Run it from outside the checkout's root (``cd /tmp``); it starts the demo with this interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
KEYS = (
    "storm_to_relief_s",
    "requests_during_relief",
    "requests_10s_after",
    "tok_s_10s_after",
    "preempt_s_10s_after",
    "rollout_s",
    "requests_during_rollout",
)


def run_once(out: Path, live: bool, quick: bool, model: str | None) -> dict:
    command = [sys.executable, "-m", "kvpilot.operator.demo.run", "--out", str(out)]
    command += [] if live else ["--no-live"]
    command += ["--quick"] if quick else []
    command += ["--model", model] if model else []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    began = time.time()
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd="/tmp")
    summary = json.loads((out / "summary.json").read_text())
    row = {key: summary.get(key) for key in KEYS}
    span = summary.get("after_detection") or {}
    row.update(
        requests_10s_after=span.get("requests"),
        tok_s_10s_after=span.get("output_tokens_per_s"),
        preempt_s_10s_after=span.get("preemptions_per_s_per_replica"),
    )
    row.update(
        live=live,
        passed=done.returncode == 0,
        relief_applied_by=summary.get("relief_applied_by"),
        levers=[(c["lever"], c.get("appliedBy")) for c in summary.get("remediations", [])],
        before_tok_s=(summary.get("before") or {}).get("output_tokens_per_s"),
        after_tok_s=(summary.get("after") or {}).get("output_tokens_per_s"),
        refused=summary.get("refused_requests"),
        wall_s=round(time.time() - began, 1),
    )
    return row


def median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="the demo's short scenario")
    parser.add_argument("--model", default=None, help="a Hugging Face model dir (default: the demo's)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/kvpilot-demo-bench"))
    args = parser.parse_args()
    rows: list[dict] = []
    for index in range(args.rounds):
        for live in (True, False):
            row = run_once(args.out, live, args.quick, args.model)
            rows.append(row)
            how = "live" if live else "rollout only"
            print(f"round {index + 1} {how:>12}: {json.dumps(row)}", flush=True)
    table = {}
    for live in (True, False):
        chosen = [r for r in rows if r["live"] is live]
        table["live" if live else "rollout"] = {key: median(chosen, key) for key in KEYS}
    print()
    print(f"{'median of ' + str(args.rounds):28}{'live first':>14}{'rollout only':>14}")
    labels = {
        "storm_to_relief_s": "storm -> relief (s)",
        "requests_during_relief": "requests completed meanwhile",
        "requests_10s_after": "requests, first 10 s after",
        "tok_s_10s_after": "output tok/s, first 10 s",
        "preempt_s_10s_after": "preemptions/s, first 10 s",
        "rollout_s": "restart lever rollout (s)",
        "requests_during_rollout": "requests during the rollout",
    }
    for key, label in labels.items():
        cells = [table[k][key] for k in ("live", "rollout")]
        print(f"{label:28}" + "".join(f"{'-' if v is None else f'{v:g}':>14}" for v in cells))
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "demo_live_vs_rollout.json"
    path.write_text(json.dumps({"rounds": rows, "medians": table, "quick": args.quick}, indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
