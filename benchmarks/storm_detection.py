"""How often the remediation policy calls a Poisson preemption storm a storm, by its rate against the
threshold: synthetic recordings replayed through the operator's own policy (``kvpilot replay``'s path).

Each recording: ``pods`` engines whose preemption counters grow by Poisson counts at ``rate`` x the
threshold (``preemptionRate``) per replica, scraped every ``interval`` seconds, for ``windows`` full
windows after the first one fills. The replay runs in mode Recommend, so no change is ever made; each tick's
``KVCachePressure`` condition says whether that tick's window is a storm (the fraction of such ticks
is the chance that one window triggers), and the first recommendation is when Auto would have applied
its first change.

Reported per (threshold setting, rate, interval): the fraction of windows that trigger, the fraction of
seeds that trigger within two windows of the storm's start (one to fill the window, one more), and the
counting bound: the chance that the window's Poisson count alone exceeds the threshold's
(``P(N > threshold x window x pods)``), which no rule that acts on the window's count can beat.

    python benchmarks/storm_detection.py                 # both settings, 50 seeds, JSON to results/
    python benchmarks/storm_detection.py --seeds 10
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

try:
    from tests.operator.engine_metrics import EngineMetrics
    from tests.operator.test_policy import isvc as policy_isvc
except ImportError:  # run as a script: put the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.operator.engine_metrics import EngineMetrics
    from tests.operator.test_policy import isvc as policy_isvc

from kvpilot.operator.remediation.replay import read_records, replay

RESULTS = Path(__file__).resolve().parent / "results"
T0 = 1_767_225_600.0
RATES = (0.8, 1.2, 1.5, 3.0)
INTERVALS = (1.0, 2.0, 5.0)


def isvc(threshold: float, window_s: float, pods: int) -> dict[str, Any]:
    """The policy tests' InferenceService, in mode Recommend, with this threshold, window and replicas."""
    return policy_isvc(
        replicas=pods,
        remediation={"mode": "Recommend", "preemptionRate": threshold, "window": f"{window_s:g}s"},
    )


# The two settings: the CRD's defaults with two replicas, and a single vLLM server at 0.5/s.
SETTINGS = {
    "defaults": {"threshold": 0.05, "window_s": 120.0, "pods": 2},
    "single": {"threshold": 0.5, "window_s": 30.0, "pods": 1},
}


def recording(
    threshold: float, window_s: float, pods: int, rate: float, interval: float, seed: int, windows: float
) -> list[str]:
    """JSON lines: every pod scraped every ``interval`` s from T0 until ``windows`` windows after the
    first full one, its counter grown by a Poisson count of mean ``rate * threshold * interval``."""
    rng = np.random.default_rng(seed)
    engines = [EngineMetrics(max_num_seqs=64) for _ in range(pods)]
    steps = int(round((1 + windows) * window_s / interval))
    lines = []
    for step in range(steps + 1):
        t = T0 + step * interval
        for index, engine in enumerate(engines):
            if step:
                engine.preempt(float(rng.poisson(rate * threshold * interval)))
            engine.set(kv=0.9, waiting=0, running=40)
            record = {"time": t + 0.001 * index, "tick": t, "pod": f"llm-{index}", "ready": True,
                      "metrics": engine.text()}  # fmt: skip
            lines.append(json.dumps(record))
    return lines


def judge(setting: dict[str, float], rate: float, interval: float, seed: int, windows: float = 2.0):
    """(per-tick storm flags once the window is full, seconds from the storm's start to the first)."""
    obj = isvc(**setting)
    lines = recording(**setting, rate=rate, interval=interval, seed=seed, windows=windows)
    records = read_records(lines, obj)
    flags, first = [], None
    for t, decision, state in replay(obj, records, stale_after_s=3 * interval):
        if t - T0 < setting["window_s"] - 1e-6:
            continue
        # The tick's own verdict: KVCachePressure for a storm in this window (not the hysteresis that
        # keeps it "subsiding"), whatever the cooldown after the first recommendation holds back.
        flags.append(any(is_storm_condition(c) for c in state.get("status", {}).get("conditions", [])))
        if decision.action == "recommend" and first is None:
            first = t - T0
    return flags, first


def is_storm_condition(condition: dict[str, Any]) -> bool:
    return (
        condition.get("type") == "KVCachePressure"
        and condition.get("status") == "True"
        and condition.get("reason") == "PreemptionStorm"
        and not str(condition.get("message", "")).startswith("subsiding")
    )


def counting_bound(setting: dict[str, float], rate: float) -> float:
    """P(N > threshold x window x pods) for N ~ Poisson(rate x that): the whole-window count test."""
    mean_at_threshold = setting["threshold"] * setting["window_s"] * setting["pods"]
    lam = rate * mean_at_threshold
    k_max = math.floor(mean_at_threshold)  # N > mean  <=>  N >= floor(mean) + 1
    term, cdf = math.exp(-lam), 0.0
    for k in range(k_max + 1):
        cdf += term
        term *= lam / (k + 1)
    return 1.0 - cdf


def table(name: str, seeds: int, rates=RATES, intervals=INTERVALS) -> list[dict[str, Any]]:
    setting = SETTINGS[name]
    rows = []
    for interval in intervals:
        for rate in rates:
            ticks, triggered, within_two = 0, 0, 0
            for seed in range(seeds):
                flags, first = judge(setting, rate, interval, seed)
                ticks += len(flags)
                triggered += sum(flags)
                within_two += first is not None and first <= 2 * setting["window_s"] + 1e-6
            rows.append(
                {
                    "setting": name,
                    **setting,
                    "interval_s": interval,
                    "rate_x": rate,
                    "seeds": seeds,
                    "windows_triggering": round(triggered / ticks, 3),
                    "seeds_within_two_windows": round(within_two / seeds, 3),
                    "counting_bound": round(counting_bound(setting, rate), 3),
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=50)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--out", type=Path, default=RESULTS / "storm_detection.json")
    args = ap.parse_args(argv)
    rows = []
    print(
        f"{'setting':9s} {'scrape':>6s} {'rate':>5s} {'windows':>8s} {'2 windows':>9s} {'count bound':>11s}"
    )
    for name in args.settings.split(","):
        for row in table(name, args.seeds):
            rows.append(row)
            print(
                f"{name:9s} {row['interval_s']:5.0f}s {row['rate_x']:4.1f}x {row['windows_triggering']:8.3f} "
                f"{row['seeds_within_two_windows']:9.2f} {row['counting_bound']:11.3f}"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "settings": SETTINGS}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
