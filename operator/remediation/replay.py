"""``kvpilot replay``: run recorded scrapes through the remediation policy, offline.

The metrics play back as recorded (they do not react), but the policy's own decisions update the
effective configuration, the history and the cooldown exactly as in the operator: each evaluation
runs ``remediation.evaluate`` and applies its status patch to an in-memory copy of the
InferenceService. So a team can ask "what would kvpilot have done last night?" before turning Auto on.

Samples are JSON Lines, one scrape per line (``kvpilot operator --record FILE`` writes them)::

    {"time": 1735787045.2, "pod": "llama-6d4f-abcde", "ready": true, "metrics": "<Prometheus text>"}

``metrics`` may also hold parsed samples (``{"name": value}`` or a list of ``{"name", "labels",
"value"}``); ``"metrics": null`` with ``"error"`` is a failed scrape. Optional keys: ``tick`` (lines of
one scrape round share it; the policy evaluates once per tick, else once per distinct ``time``),
``evaluated`` (when the operator judged that tick: the replay judges it then too, so that a window is
exactly as full as it was; without it, at the tick's latest scrape), ``namespace`` and
``inferenceService`` (lines of other InferenceServices are skipped).

A replay knows no pod list: the pods are those the file names. In a file where every line has a
``tick`` (as the operator records: each tick lists every pod of the current configuration, failed
scrapes and pods that are not ready included), a pod missing from a tick is gone (scaled down or
replaced). Otherwise a pod not seen for longer than the window plus the staleness bound is taken as
gone; until then, a silent pod is stale and the policy does not act.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import statistics
from collections.abc import Iterable, Iterator
from typing import Any

from kvpilot.operator.api.patch import merge_patch
from kvpilot.operator.api.settings import resolve
from kvpilot.operator.api.timefmt import format_time
from kvpilot.operator.remediation.decision import AUTO, OFF, RECOMMEND, Decision, history_from_status
from kvpilot.operator.remediation.evaluate import evaluate
from kvpilot.operator.remediation.series import PodSeries
from kvpilot.operator.remediation.window import summarize

MODES = (AUTO, RECOMMEND, OFF)
STALE_INTERVALS = 3.0  # a pod is stale after this many of its scrape intervals without a sample


class ReplayError(ValueError):
    """The InferenceService or the samples cannot be replayed; the message says why."""


@dataclasses.dataclass(frozen=True)
class Record:
    """One line of a samples file."""

    time: float
    pod: str
    tick: float
    ready: bool = True
    metrics: Any = None
    error: str | None = None
    has_tick: bool = False
    evaluated: float | None = None


def read_records(lines: Iterable[str], isvc: dict[str, Any] | None = None) -> list[Record]:
    """Parse JSON Lines (blank lines skipped), keeping those of ``isvc`` (by name and namespace when the
    lines carry them), sorted by tick. Raises ReplayError naming the first bad line."""
    meta = (isvc or {}).get("metadata") or {}
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            if not isinstance(item, dict):
                raise TypeError("not an object")
            if item.get("inferenceService") not in (None, meta.get("name")):
                continue
            if item.get("namespace") not in (None, meta.get("namespace"), "") and meta.get("namespace"):
                continue
            time = float(item["time"])
            metrics = item.get("metrics")
            error = item.get("error")
            if metrics is None and error is None:
                error = "no metrics in the record"
            records.append(
                Record(
                    time=time,
                    pod=str(item["pod"]),
                    tick=float(item.get("tick", time)),
                    ready=bool(item.get("ready", True)),
                    metrics=metrics,
                    error=None if error is None else str(error),
                    has_tick="tick" in item,
                    evaluated=None if item.get("evaluated") is None else float(item["evaluated"]),
                )
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ReplayError(f"line {number}: not a sample record ({exc})") from exc
    if not records:
        raise ReplayError("no sample records" + (f" for {meta.get('name')}" if meta.get("name") else ""))
    return sorted(records, key=lambda r: (r.tick, r.time))


def default_stale_after(records: list[Record]) -> float:
    """``STALE_INTERVALS`` x the median interval between a pod's consecutive samples (at least 1 s)."""
    last: dict[str, float] = {}
    gaps = []
    for record in records:
        if record.pod in last and record.time > last[record.pod]:
            gaps.append(record.time - last[record.pod])
        last[record.pod] = record.time
    return max(1.0, STALE_INTERVALS * statistics.median(gaps)) if gaps else 1.0


def replay(
    isvc: dict[str, Any],
    records: list[Record],
    *,
    mode: str | None = None,
    stale_after_s: float | None = None,
    plan: bool | None = None,
) -> Iterator[tuple[float, Decision, dict[str, Any]]]:
    """Yield (time, decision, InferenceService after it) for each evaluation (one per tick).

    ``mode`` replaces ``spec.remediation.mode`` (None: the manifest's); ``plan`` likewise
    ``spec.remediation.plan.enabled``. With the plan on, a storm's restart-lever change is planned on
    the recorded scrapes since the last change (as the operator plans on the scrapes it kept). Raises
    ReplayError for an invalid InferenceService.
    """
    from kvpilot.operator.plan.advise import ScrapeHistory, planner_for  # the plan reads records

    state = copy.deepcopy(isvc)
    state.setdefault("metadata", {}).setdefault("generation", 1)
    if mode is not None:
        if mode not in MODES:
            raise ReplayError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        state.setdefault("spec", {}).setdefault("remediation", {})["mode"] = mode
    if plan is not None:
        remediation = state.setdefault("spec", {}).setdefault("remediation", {})
        remediation["plan"] = {**(remediation.get("plan") or {}), "enabled": plan}
    settings = resolve(state)
    if not settings.is_valid:
        raise ReplayError("invalid InferenceService: " + "; ".join(settings.problems))
    window_s = settings.remediation.window_s
    stale_after = stale_after_s if stale_after_s is not None else default_stale_after(records)
    forget_after = window_s + stale_after
    retention = window_s + 2 * stale_after
    ticked = all(r.has_tick for r in records)
    series: dict[str, PodSeries] = {}
    ready: dict[str, bool] = {}
    seen: dict[str, float] = {}
    kept = ScrapeHistory(settings.remediation.plan.lookback_s, eager=False)
    index = 0
    while index < len(records):
        tick = records[index].tick
        now = tick
        in_tick: set[str] = set()
        while index < len(records) and records[index].tick == tick:
            record = records[index]
            index += 1
            in_tick.add(record.pod)
            now = max(now, record.time if record.evaluated is None else record.evaluated)
            seen[record.pod], ready[record.pod] = record.time, record.ready
            pod = series.setdefault(record.pod, PodSeries(record.pod, retention))
            if record.ready:
                pod.ingest(record.time, record.metrics, record.error)
                if record.error is None and record.metrics is not None:
                    kept.add(record.pod, record.pod, record.time, record.metrics)
        if ticked:
            present = sorted(in_tick)
        else:
            present = [name for name in series if now - seen[name] <= forget_after]
        unready = [name for name in present if not ready[name]]
        window = summarize(
            {name: series[name] for name in present if ready[name]},
            now=now,
            window_s=window_s,
            stale_after_s=stale_after,
            problems=[f"pod(s) not ready: {', '.join(unready)}"] if unready else [],
        )
        since = _last_change(state)
        scrapes = functools.partial(kept.scrapes, [n for n in present if ready[n]], since, now)
        decision, update = evaluate(settings, window, now, planner=planner_for(settings, scrapes))
        if update.patch is not None:
            state = {**state, "status": merge_patch(state.get("status"), update.patch)}
            settings = settings.with_status(state)
        yield now, decision, state


def _last_change(isvc: dict[str, Any]) -> float:
    """When the latest applied change was made (-inf: none): the pods ran the settings in force since
    (a recommendation changes nothing)."""
    history = history_from_status((isvc.get("status") or {}).get("remediations"))
    return history[0].time if history else float("-inf")


def compare_paths(planned: list[tuple[float, Decision]], ladder: list[tuple[float, Decision]]) -> str:
    """The changes of the two runs of ``kvpilot replay --both-paths``, one line each (the recorded
    metrics do not react to a change, so this compares what each path does, not how soon it calms)."""
    start = min((t for t, _ in planned + ladder), default=0.0)

    def line(name: str, timed: list[tuple[float, Decision]]) -> str:
        changes = [(t, d) for t, d in timed if d.is_change]
        what = "; ".join(f"{d.field} {d.from_:g} → {d.to:g} at +{t - start:.0f}s" for t, d in changes)
        return f"{name}: {len(changes)} change(s)" + (f": {what}" if what else "")

    return line("with the plan", planned) + "\n" + line("the ladder alone", ladder)


def format_table(rows: list[tuple[float, Decision]]) -> str:
    """The default output: one row per evaluation; PATH says how a storm's change was chosen (plan,
    ladder; - where the plan was not consulted)."""
    header = ("TIME", "ACTION", "LEVER", "FIELD", "FROM", "TO", "PATH", "REASON")
    table = [header]
    for time, decision in rows:
        change = decision.is_change
        table.append(
            (
                format_time(time),
                decision.action,
                (decision.lever or "-") if change else "-",
                (decision.field or "-") if change else "-",
                f"{decision.from_:g}" if change else "-",
                f"{decision.to:g}" if change else "-",
                (decision.path or "-") if change else "-",
                decision.reason,
            )
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)) + "  " + row[-1]
        for row in table
    )


def summary(decisions: list[Decision], final: dict[str, Any]) -> str:
    """The closing line of the table output: counts and the overrides in effect at the end."""
    counts = {action: sum(1 for d in decisions if d.action == action) for action in ("apply", "recommend")}
    effective = ((final.get("status") or {}).get("effective") or {}).get("overrides") or {}
    overrides = ", ".join(f"{key} {value['value']:g}" for key, value in sorted(effective.items())) or "none"
    return (
        f"{len(decisions)} evaluation(s): {counts['apply']} applied, {counts['recommend']} recommended; "
        f"overrides at the end: {overrides}"
    )
