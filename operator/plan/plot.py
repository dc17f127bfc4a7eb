"""``kvpilot plan --plot PATH``: the plan as a PNG of two panels.

* **Predicted vs recorded** for the settings in force: the recording cut into windows as long as
  its typical scrape interval; per window, the preemptions per second per pod the recording counted
  and those the simulation of the settings in force counted over the same stretch of the arrivals'
  clock (one replica), with the storm threshold; on a second axis, the output tokens per second,
  service-wide, recorded and predicted. Windows past the recording's end show the prediction alone
  (a simulation still draining its queue).
* **The frontier of candidates**: each candidate simulated as a point, x its GPUs (replicas x GPUs
  per replica), y its predicted preemption rate per replica over the worst remediation window (what
  the storm threshold is compared with), coloured by whether it is eligible; the lowest rate for at
  most each GPU count as a step line, the threshold as a horizontal line, the settings in force and
  the pick labelled.

The series are pure functions of the plan's inputs (:func:`window_edges`, :func:`recorded_rates`,
:func:`predicted_rates`); only :func:`write_plan_plot` needs matplotlib, imported when it is called,
so the operator imports this module without it.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpilot.engine import metrics_names as m
from kvpilot.operator.plan.candidates import Candidate, CandidateResult
from kvpilot.operator.plan.recording import Interval, PlanScrape, intervals_of
from kvpilot.operator.plan.simulate import SimResult

LABEL_BOX = {"facecolor": "white", "alpha": 0.8, "edgecolor": "none"}
CANDIDATE_GID = "candidate"  # the scatter collections that hold one point per simulated candidate
PANEL_GID = "panel"  # the two panels (their twin axes carry none)


def window_edges(intervals: Sequence[Interval], origin: float, end_s: float) -> list[float]:
    """Window edges (seconds from ``origin``) from 0 to ``end_s``, each window the median interval
    long (at least one second); the last one ends at ``end_s``, shorter when it must."""
    width = max(1.0, statistics.median(i.seconds for i in intervals)) if intervals else 1.0
    edges = [0.0]
    while edges[-1] + width < end_s - 1e-9:
        edges.append(edges[-1] + width)
    edges.append(max(end_s, edges[-1] + 1e-9) if end_s > 0 else width)
    return edges


def _spread(
    intervals: Sequence[Interval], origin: float, edges: Sequence[float], counter: str
) -> list[float]:
    """The increase of ``counter`` in each window, an interval's increase shared among the windows it
    overlaps in proportion to the overlap; NaN in a window no interval with the counter touches."""
    totals = [0.0] * (len(edges) - 1)
    covered = [False] * (len(edges) - 1)
    for interval in intervals:
        delta = interval.counters.get(counter)
        if delta is None or interval.seconds <= 0:
            continue
        start, end = interval.start - origin, interval.end - origin
        first = max(0, bisect.bisect_right(edges, start) - 1)
        for k in range(first, len(totals)):
            if edges[k] >= end:
                break
            low, high = max(start, edges[k]), min(end, edges[k + 1])
            if high > low:
                totals[k] += delta * (high - low) / interval.seconds
                covered[k] = True
    return [t if c else math.nan for t, c in zip(totals, covered, strict=True)]


def recorded_rates(
    intervals: Sequence[Interval], origin: float, edges: Sequence[float], num_pods: int
) -> tuple[list[float], list[float]]:
    """Per window: the recorded preemptions per second per pod, and the recorded output tokens per
    second service-wide (NaN where the recording says nothing)."""
    widths = [b - a for a, b in zip(edges, edges[1:], strict=False)]
    preemptions = _spread(intervals, origin, edges, m.NUM_PREEMPTIONS_TOTAL)
    tokens = _spread(intervals, origin, edges, m.GENERATION_TOKENS_TOTAL)
    pods = max(num_pods, 1)
    return (
        [p / w / pods for p, w in zip(preemptions, widths, strict=True)],
        [t / w for t, w in zip(tokens, widths, strict=True)],
    )


def predicted_rates(
    result: SimResult, edges: Sequence[float], replicas: int
) -> tuple[list[float], list[float]]:
    """Per window (edges on the arrivals' clock): the simulated replica's preemptions per second,
    and the output tokens per second service-wide (that replica's times ``replicas``). Counts between
    steps are those of the last step that ended; a window before the first arrival, or after the end
    of a run stopped with requests unfinished, is NaN; after a run that finished everything, 0."""
    times = [result.start_s] + [result.start_s + s.time for s in result.samples]
    preempted = [0] + [s.num_preemptions for s in result.samples]
    tokens = [0] + [s.num_output_tokens for s in result.samples]
    run_end = times[-1]

    def at(series: list[int], t: float) -> int:
        return series[max(0, bisect.bisect_right(times, t) - 1)]

    rates: list[float] = []
    throughput: list[float] = []
    for low, high in zip(edges, edges[1:], strict=False):
        if (result.truncated and low >= run_end) or high <= result.start_s:
            rates.append(math.nan)
            throughput.append(math.nan)
            continue
        width = high - low
        rates.append((at(preempted, high) - at(preempted, low)) / width)
        throughput.append((at(tokens, high) - at(tokens, low)) / width * replicas)
    return rates, throughput


def _total(rates: Sequence[float], widths: Sequence[float]) -> float:
    """The count behind per-window ``rates`` (NaN windows left out)."""
    return sum(r * w for r, w in zip(rates, widths, strict=False) if not math.isnan(r))


def _frontier(points: Sequence[tuple[int, float]]) -> list[tuple[int, float]]:
    """(GPUs, the lowest rate of any point with at most that many GPUs) at each GPU count."""
    out: list[tuple[int, float]] = []
    best = math.inf
    for gpus in sorted({g for g, _ in points}):
        best = min(best, min(r for g, r in points if g == gpus))
        out.append((gpus, best))
    return out


def _jitter(results: Sequence[CandidateResult]) -> list[float]:
    """x of each result: its GPUs, spread a little among those with as many GPUs."""
    by_gpus: dict[int, list[int]] = {}
    for index, r in enumerate(results):
        by_gpus.setdefault(r.num_gpus, []).append(index)
    xs = [0.0] * len(results)
    for gpus, members in by_gpus.items():
        for rank, index in enumerate(members):
            xs[index] = gpus + (rank - (len(members) - 1) / 2) * min(0.08, 0.5 / len(members))
    return xs


def write_plan_plot(
    path: str | Path,
    scrapes: Sequence[PlanScrape],
    results: Sequence[CandidateResult],
    chosen: CandidateResult | None,
    current: Candidate,
    preemption_rate: float,
    window_s: float,
    num_pods: int,
    title: str = "kvpilot plan",
) -> dict[str, Any] | None:
    """Draw the two panels (module doc) into a PNG at ``path``. Returns None without matplotlib, else
    what the figure holds, read back from its artists: ``panels`` (titles), ``num_windows``,
    ``num_points`` (candidate points drawn), ``labels`` (the annotations of the candidate panel),
    ``in_force`` and ``chosen`` (their labels, ``chosen`` None without a pick), ``skipped`` (labels
    of candidates without a simulation, not drawn), the first panel's preemption series
    (``windows_s``: where each window starts; ``recorded_per_s`` per pod, ``predicted_per_s`` per
    replica, NaN where there is none) and ``preemptions`` (``recorded`` and ``predicted``: those
    rates times their windows' lengths, summed). Raises OSError when the file cannot be written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    intervals = intervals_of(scrapes)
    origin = min(s.time for s in scrapes)
    recording_end = max(s.time for s in scrapes) - origin
    in_force = next((r for r in results if r.is_current), None)
    sim = in_force.result if in_force is not None else None
    end = recording_end if sim is None else max(recording_end, sim.start_s + sim.duration_s)
    edges = window_edges(intervals, origin, end)
    mids = [(a + b) / 2 for a, b in zip(edges, edges[1:], strict=False)]
    widths = [b - a for a, b in zip(edges, edges[1:], strict=False)]
    rec_rate, rec_tokens = recorded_rates(intervals, origin, edges, num_pods)
    pred_rate, pred_tokens = predicted_rates(sim, edges, current.replicas) if sim is not None else ([], [])

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 8.5), constrained_layout=True)
    storm = f"storm threshold ({preemption_rate:g}/s over {window_s:g}s)"
    top.plot(mids, rec_rate, color="tab:red", marker=".", label="preemptions/s per pod, recorded")
    if sim is not None:
        top.plot(
            mids,
            pred_rate,
            color="tab:purple",
            linestyle="--",
            marker=".",
            label="preemptions/s per replica, predicted",
        )
    top.axhline(preemption_rate, color="tab:red", linestyle=":", linewidth=1, label=storm)
    if end > recording_end:  # the simulation drains past the recording's end
        top.axvline(recording_end, color="tab:gray", linestyle=":", linewidth=1)
        top.annotate(
            "recording ends", (recording_end, 0.5), xycoords=("data", "axes fraction"), xytext=(4, 0),
            textcoords="offset points", fontsize=8, color="tab:gray", bbox=LABEL_BOX,
        )  # fmt: skip
    top.set_xlabel(f"seconds since the recording started ({edges[1] - edges[0]:.3g}s windows)")
    top.set_ylabel("preemptions/s")
    top.set_title("predicted vs recorded, settings in force")
    tokens = top.twinx()
    tokens.plot(mids, rec_tokens, color="tab:blue", alpha=0.6, label="output tok/s, recorded")
    if sim is not None:
        tokens.plot(
            mids, pred_tokens, color="tab:cyan", linestyle="--", alpha=0.8, label="output tok/s, predicted"
        )
    tokens.set_ylabel("output tokens/s (service)")
    tokens.set_ylim(bottom=0)
    handles, labels = top.get_legend_handles_labels()
    more = tokens.get_legend_handles_labels()
    top.legend(handles + more[0], labels + more[1], loc="upper left", fontsize=8)

    drawn = [r for r in results if r.result is not None and math.isfinite(r.max_preemption_rate)]
    xs = _jitter(drawn)
    groups = (
        ("eligible", "tab:green", lambda r: r.eligible),
        ("sustained preemption", "tab:red", lambda r: r.keeps_up and r.sustained_preemption),
        ("falls behind", "tab:gray", lambda r: not r.keeps_up),
    )
    for name, color, member in groups:
        picked = [(x, r.max_preemption_rate) for x, r in zip(xs, drawn, strict=True) if member(r)]
        if picked:
            points = bottom.scatter(*zip(*picked, strict=True), color=color, s=36, zorder=3, label=name)
            points.set_gid(CANDIDATE_GID)
    line = _frontier([(r.num_gpus, r.max_preemption_rate) for r in drawn])
    if line:
        bottom.step(
            *zip(*line, strict=True), where="post", color="black", alpha=0.4, label="lowest at that cost"
        )
    bottom.axhline(preemption_rate, color="tab:red", linestyle=":", linewidth=1, label=storm)
    for x, r in zip(xs, drawn, strict=True):
        if r.is_current or r is chosen:
            text = ("in force" if r.is_current else "") + (" = " if r.is_current and r is chosen else "")
            text += f"pick: {r.candidate.label(current)}" if r is chosen else ""
            color = "tab:green" if r is chosen else "tab:purple"
            bottom.scatter([x], [r.max_preemption_rate], s=160, facecolors="none", edgecolors=color, zorder=4)
            bottom.annotate(
                text, (x, r.max_preemption_rate), xytext=(8, 6), textcoords="offset points",
                fontsize=8, color=color, bbox=LABEL_BOX,
            )  # fmt: skip
    bottom.set_yscale("symlog", linthresh=max(preemption_rate, 1e-3))
    peak = max((r.max_preemption_rate for r in drawn), default=0.0)
    bottom.set_ylim(0, 3 * max(peak, preemption_rate))
    bottom.set_xticks(sorted({r.num_gpus for r in drawn}) or [1])
    bottom.set_xlabel("GPUs (replicas x GPUs per replica)")
    bottom.set_ylabel(f"predicted preemptions/s per replica\n(worst {window_s:g}s window)")
    bottom.set_title(f"candidates: cost vs predicted preemption ({len(drawn)} simulated)")
    bottom.legend(loc="upper right", fontsize=8)
    top.set_gid(PANEL_GID)
    bottom.set_gid(PANEL_GID)
    fig.suptitle(title)
    try:
        fig.savefig(path, dpi=120)
        return {
            "panels": [a.get_title() for a in fig.axes if a.get_gid() == PANEL_GID],
            "num_windows": len(mids),
            "num_points": sum(
                len(c.get_offsets()) for c in bottom.collections if c.get_gid() == CANDIDATE_GID
            ),
            "labels": [t.get_text() for t in bottom.texts],
            "in_force": None if in_force is None else in_force.candidate.label(current),
            "chosen": None if chosen is None else chosen.candidate.label(current),
            "windows_s": edges[:-1],
            "recorded_per_s": rec_rate,
            "predicted_per_s": pred_rate,
            "preemptions": {"recorded": _total(rec_rate, widths), "predicted": _total(pred_rate, widths)},
            "skipped": [r.candidate.label(current) for r in results if id(r) not in {id(d) for d in drawn}],
        }
    finally:
        plt.close(fig)
