"""What the demo measured: the timeline it sampled, the requests it sent, the summary and the plot.

Pure except :func:`write_plot` (matplotlib, the ``demo`` extra; imported only there). Phases, in seconds
since the load started::

    |-- warm-up --|------- before --------|-- remediation(s) --|-- settle --|------ after ------|
    load start    +3 s                    first change         settled      +2 s                end

"Settled": no live relief in force and every rollout complete. Two costs are measured from the first
change (the storm detected): the time to *relief* (the preemption rate below the storm threshold for
``RELIEF_HOLD_S``) and the rollout of the restart lever (its change until every replica runs it), each
with the requests completed meanwhile.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

WARMUP_S = 3.0
SETTLE_S = 2.0
RELIEF_HOLD_S = 5.0
AFTER_DETECTION_S = 10.0  # the span after the first change whose requests the summary counts
LABEL_BOX = {"facecolor": "white", "alpha": 0.8, "edgecolor": "none"}


@dataclasses.dataclass(frozen=True)
class Sample:
    """One look at the platform: replicas, and summed over the ready replicas since the last look."""

    time: float
    replicas_ready: int
    replicas_desired: int
    preemption_rate: float  # all replicas, per second since the previous sample
    preemptions: float
    kv_usage: float | None  # mean over replicas, 0..1
    waiting: float
    running: float
    num_blocks: int | None
    gpu_memory_utilization: float | None
    max_num_seqs: int | None = None


@dataclasses.dataclass(frozen=True)
class Trip:
    """One completed request: start, first token and end (unix seconds), output tokens."""

    start: float
    first_token: float
    end: float
    tokens: int

    @property
    def ttft(self) -> float:
        return self.first_token - self.start


@dataclasses.dataclass
class Timeline:
    """Samples and the remediations seen (``t``: seconds since ``t0``)."""

    t0: float
    samples: list[Sample] = dataclasses.field(default_factory=list)
    changes: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        rows = [{**dataclasses.asdict(s), "t": round(s.time - self.t0, 2)} for s in self.samples]
        return {"samples": rows, "remediations": self.changes}


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def phase(timeline: Timeline, trips: list[Trip], begin: float, end: float) -> dict[str, Any]:
    """The numbers of one phase ``(begin, end]`` (unix seconds)."""
    samples = [s for s in timeline.samples if begin < s.time <= end]
    span = max(end - begin, 1e-9)
    replicas = sum(s.replicas_ready for s in samples) / len(samples) if samples else 0
    kv = [s.kv_usage for s in samples if s.kv_usage is not None]
    finished = [t for t in trips if begin < t.end <= end]
    started = [t.ttft for t in trips if begin < t.start <= end]
    blocks = [s.num_blocks for s in samples if s.num_blocks is not None]
    preemptions = sum(s.preemptions for s in samples)
    return {
        "seconds": round(span, 1),
        "preemptions_per_s_per_replica": round(preemptions / span / max(replicas, 1), 2),
        "kv_cache_usage": round(sum(kv) / len(kv), 3) if kv else None,
        "output_tokens_per_s": round(sum(t.tokens for t in finished) / span, 1),
        "ttft_p50_s": percentile(started, 50),
        "ttft_p99_s": percentile(started, 99),
        "requests": len(finished),
        "num_gpu_blocks": min(blocks) if blocks else None,
    }


def relief_time(
    timeline: Timeline, since: float, threshold: float, hold_s: float = RELIEF_HOLD_S
) -> float | None:
    """When, after ``since``, the preemption rate per replica fell below ``threshold`` to stay there for
    ``hold_s`` (the start of the first such stretch; None: never)."""
    samples = [s for s in timeline.samples if s.time > since]
    start = None
    previous = since
    for sample in samples:
        rate = sample.preemption_rate / max(sample.replicas_ready, 1)
        if rate < threshold:
            start = previous if start is None else start
            if sample.time - start >= hold_s:
                return start
        else:
            start = None
        previous = sample.time
    return None


def costs(timeline: Timeline, trips: list[Trip], marks: dict[str, float], threshold: float) -> dict[str, Any]:
    """From the first change: time to relief and how the change that brought it was applied; the
    restart lever's rollout time; the requests completed over each."""
    out: dict[str, Any] = {}
    first = timeline.changes[0] if timeline.changes else None
    if first is None:
        return out
    detected = first["at"]
    relieved = relief_time(timeline, detected, threshold)
    out["first_change"] = {"lever": first["lever"], "applied_by": first.get("appliedBy") or "rollout"}
    if relieved is not None:
        by = [c for c in timeline.changes if c["at"] <= relieved][-1]
        out["storm_to_relief_s"] = round(relieved - detected, 1)
        out["relief_applied_by"] = by.get("appliedBy") or "rollout"
        out["requests_during_relief"] = sum(1 for t in trips if detected < t.end <= relieved)
    # What the clients got while the change took effect: the same span after detection in every run.
    span = phase(timeline, trips, detected, detected + AFTER_DETECTION_S)
    out["after_detection"] = {
        "seconds": AFTER_DETECTION_S,
        "requests": span["requests"],
        "output_tokens_per_s": span["output_tokens_per_s"],
        "preemptions_per_s_per_replica": span["preemptions_per_s_per_replica"],
    }
    rollout = next((c for c in timeline.changes if (c.get("appliedBy") or "rollout") == "rollout"), None)
    if rollout is not None and "rolled_out" in marks:
        out["rollout_lever"] = rollout["lever"]
        out["rollout_s"] = round(marks["rolled_out"] - rollout["at"], 1)
        out["requests_during_rollout"] = sum(1 for t in trips if rollout["at"] < t.end <= marks["rolled_out"])
    return out


def _fmt_s(value: float | None) -> str:
    return f"{value:.2f} s" if value is not None else "-"


def summarize_run(
    timeline: Timeline,
    trips: list[Trip],
    refused: int,
    marks: dict[str, float],
    threshold: float,
    calibration: dict[str, Any],
) -> dict[str, Any]:
    """Before/after numbers, whether the loop closed (and why not), and the summary text."""
    t0, end = marks["load_start"], marks["end"]
    remediated = marks.get("remediation")
    before = phase(timeline, trips, t0 + WARMUP_S, remediated or end)
    after = phase(timeline, trips, marks["settled"] + SETTLE_S, end) if "settled" in marks else None
    cost = costs(timeline, trips, marks, threshold)
    why_not = None
    if remediated is None:
        why_not = "no remediation was applied"
    elif before["preemptions_per_s_per_replica"] <= threshold:
        why_not = f"there was no storm before the remediation ({before['preemptions_per_s_per_replica']}/s)"
    elif after is None or after["seconds"] < 1:
        why_not = "the new configuration never served on its own"
    elif after["preemptions_per_s_per_replica"] >= threshold:
        rate = after["preemptions_per_s_per_replica"]
        why_not = f"the preemption rate stayed above {threshold:g}/s ({rate}/s)"
    lines = ["== kvpilot demo: summary =="]
    for change in timeline.changes:
        lines.append(
            f"remediation at +{change['t']:.0f}s: {change['lever']}: {change['field']} "
            f"{change['from']:g} -> {change['to']:g} (applied by {change.get('appliedBy') or 'rollout'}"
            + (f", path {change['path']})" if change.get("path") else ")")
        )
        lines.append(f"  why: {change['reason']}")
    if "storm_to_relief_s" in cost:
        how = "in place, no restart" if cost["relief_applied_by"] == "live" else "by a rolling restart"
        lines.append(
            f"storm -> relief: {cost['storm_to_relief_s']:g} s from the first change to preemptions below "
            f"{threshold:g}/s ({how}); {cost['requests_during_relief']} requests completed meanwhile"
        )
    elif remediated is not None:
        lines.append(f"storm -> relief: the preemption rate never stayed below {threshold:g}/s")
    if "after_detection" in cost:
        span = cost["after_detection"]
        lines.append(
            f"first {span['seconds']:g} s after it: {span['requests']} requests completed, "
            f"{span['output_tokens_per_s']:g} output tok/s, {span['preemptions_per_s_per_replica']:g} "
            "preemptions/s per replica"
        )
    if "rollout_s" in cost:
        lines.append(
            f"restart path: {cost['rollout_lever']} rolled out in {cost['rollout_s']:g} s (change to every "
            f"replica on it); {cost['requests_during_rollout']} requests completed meanwhile"
        )
    if remediated is not None:
        lines.append(f"requests refused or cut short over the whole run: {refused}")
    rows = [
        ("preemptions/s per replica", "preemptions_per_s_per_replica", lambda v: f"{v:g}"),
        ("KV cache usage (mean)", "kv_cache_usage", lambda v: f"{v:.0%}" if v is not None else "-"),
        ("throughput (output tok/s)", "output_tokens_per_s", lambda v: f"{v:g}"),
        ("TTFT p50", "ttft_p50_s", _fmt_s),
        ("TTFT p99", "ttft_p99_s", _fmt_s),
        ("requests completed", "requests", str),
        ("KV pool (blocks of 16)", "num_gpu_blocks", lambda v: str(v) if v is not None else "-"),
        ("phase length (s)", "seconds", lambda v: f"{v:g}"),
    ]
    lines.append(f"  {'':28}{'before':>12}{'after':>12}")
    for label, key, show in rows:
        right = show(after[key]) if after else "-"
        lines.append(f"  {label:28}{show(before[key]):>12}{right:>12}")
    if why_not is None:
        lines.append(
            f"loop closed: {before['preemptions_per_s_per_replica']:g} -> "
            f"{after['preemptions_per_s_per_replica']:g} preemptions/s per replica "
            f"(storm threshold {threshold:g})"
        )
    else:
        lines.append(f"loop NOT closed: {why_not}")
    calm = lasting_calm(timeline, timeline.changes[0]["at"], threshold) if timeline.changes else None
    calm_s = round(calm - timeline.changes[0]["at"], 1) if calm is not None else None
    restarts = sum(1 for c in timeline.changes if (c.get("appliedBy") or "rollout") == "rollout")
    lines.insert(
        -1,
        f"restart-lever changes: {restarts}; first change -> lasting calm: "
        + (f"{calm_s:g} s" if calm_s is not None else "never"),
    )
    return {
        "lasting_calm_s": calm_s,
        "requests_total": len(trips),
        "restart_lever_changes": restarts,
        "before": before,
        "after": after,
        "remediations": timeline.changes,
        **cost,
        "refused_requests": refused,
        "calibration": calibration,
        "loop_closed": why_not is None,
        "why_not": why_not,
        "text": "\n".join(lines),
    }


def lasting_calm(timeline: Timeline, since: float, threshold: float) -> float | None:
    """The start of the last stretch after ``since`` whose preemption rate per replica stays below
    ``threshold`` to the end of the timeline (None: it ends in a storm, or nothing was sampled)."""
    start = None
    previous = since
    for sample in (s for s in timeline.samples if s.time > since):
        if sample.preemption_rate / max(sample.replicas_ready, 1) < threshold:
            start = previous if start is None else start
        else:
            start = None
        previous = sample.time
    return start


def comparison_row(result: dict[str, Any], threshold: float) -> dict[str, Any]:
    """One run's numbers for the side-by-side table: restart-lever changes (rolled out), seconds from
    the first change to lasting calm, requests completed, preemptions/s before and after."""
    changes = result["remediations"]
    restarts = [c for c in changes if (c.get("appliedBy") or "rollout") == "rollout"]
    calm = result.get("lasting_calm_s")
    return {
        "restart_lever_changes": len(restarts),
        "paths": [c.get("path") or "ladder" for c in restarts],
        "values": [c["to"] for c in restarts],
        "first_change_to_calm_s": calm,
        "requests": sum(p["requests"] for p in (result["before"], result["after"] or {"requests": 0})),
        "requests_total": result.get("requests_total"),
        "before": result["before"]["preemptions_per_s_per_replica"],
        "after": (result["after"] or {}).get("preemptions_per_s_per_replica"),
        "passed": result.get("passed", result["loop_closed"]),
    }


def compare_runs(results: dict[str, dict[str, Any]], threshold: float) -> str:
    """The plan and ladder runs side by side (``results``: name -> summarize_run's result)."""
    rows = {name: comparison_row(r, threshold) for name, r in results.items()}
    names_ = list(rows)
    show = [
        ("restart-lever changes", lambda r: str(r["restart_lever_changes"])),
        ("their values", lambda r: " ".join(f"{v:g}" for v in r["values"]) or "-"),
        ("their paths", lambda r: " ".join(r["paths"]) or "-"),
        (
            "first change -> calm (s)",
            lambda r: (
                f"{r['first_change_to_calm_s']:g}" if r["first_change_to_calm_s"] is not None else "never"
            ),
        ),
        ("requests completed", lambda r: str(r["requests_total"])),
        ("preemptions/s before", lambda r: f"{r['before']:g}"),
        ("preemptions/s after", lambda r: f"{r['after']:g}" if r["after"] is not None else "-"),
        ("loop closed", lambda r: "yes" if r["passed"] else "no"),
    ]
    lines = ["== kvpilot demo: plan vs ladder ==", f"  {'':28}" + "".join(f"{n:>16}" for n in names_)]
    for label, fmt in show:
        lines.append(f"  {label:28}" + "".join(f"{fmt(rows[n]):>16}" for n in names_))
    return "\n".join(lines)


def _label(axis: Any, text: str, x: float, y: float, color: str, va: str = "baseline") -> None:
    """Text right of ``x`` (data) at height ``y`` (fraction of the axes)."""
    axis.annotate(
        text, (x, y), xycoords=("data", "axes fraction"), xytext=(4, 0), textcoords="offset points",
        fontsize=8, color=color, va=va, ha="left", bbox=LABEL_BOX,
    )  # fmt: skip


def write_plot(timeline: Timeline, marks: dict[str, float], threshold: float, path: Path) -> Path | None:
    """The timeline as a PNG: preemption rate and KV usage, remediations marked; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    t0 = timeline.t0
    xs = [s.time - t0 for s in timeline.samples]
    raw = [s.preemption_rate / max(s.replicas_ready, 1) for s in timeline.samples]
    rate = [sum(raw[max(0, i - 2) : i + 1]) / len(raw[max(0, i - 2) : i + 1]) for i in range(len(raw))]
    kv = [100 * s.kv_usage if s.kv_usage is not None else float("nan") for s in timeline.samples]
    waiting = [s.waiting for s in timeline.samples]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 6), constrained_layout=True)
    top.plot(xs, rate, color="tab:red", label="preemptions/s per replica (3 s mean)")
    storm = f"storm threshold ({threshold:g}/s)"
    top.axhline(threshold, color="tab:red", linestyle=":", linewidth=1, label=storm)
    top.set_ylabel("preemptions/s")
    top.set_title("kvpilot demo: a preemption storm, and the remediation that ends it")
    bottom.plot(xs, kv, color="tab:blue", label="KV cache usage (%)")
    bottom.set_ylabel("KV cache usage (%)")
    bottom.set_ylim(0, 105)
    bottom.set_xlabel("seconds since the load started")
    queue = bottom.twinx()
    queue.step(xs, waiting, where="post", color="tab:gray", alpha=0.6, label="requests waiting")
    queue.set_ylabel("requests waiting")
    if "rollout_change" in marks and "rolled_out" in marks:
        span = (marks["rollout_change"] - t0, marks["rolled_out"] - t0)
        for axis in (top, bottom):
            axis.axvspan(*span, color="tab:orange", alpha=0.12)
        _label(bottom, "rolling restart", span[0], 0.03, "tab:orange")
    for change in timeline.changes:
        for axis in (top, bottom):
            axis.axvline(change["t"], color="tab:orange", linestyle="--")
        how = change.get("path") or ("live" if change.get("appliedBy") == "live" else "ladder")
        label = f"{change['lever']} [{how}]\n{change['field']} {change['from']:g} → {change['to']:g}"
        _label(top, label, change["t"], 0.97, "tab:orange", va="top")
    if "rolled_out" in marks:
        _label(top, "new configuration serving", marks["rolled_out"] - t0, 0.6, "tab:green")
        for axis in (top, bottom):
            axis.axvline(marks["rolled_out"] - t0, color="tab:green", linestyle=":")
    top.legend(loc="upper right", fontsize=8)
    handles = bottom.get_legend_handles_labels()
    more = queue.get_legend_handles_labels()
    bottom.legend(handles[0] + more[0], handles[1] + more[1], loc="lower right", fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
