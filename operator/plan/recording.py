"""A recording (the JSON Lines of scrapes ``kvpilot replay`` reads) as the values the plan needs.

Each scrape becomes a :class:`PlanScrape`: the counters and histograms, summed over their series
(several ``engine`` labels of one pod add up), the gauges, the KV pool from
``vllm:cache_config_info``, and kvpilot's step counters by phase and batch class. Consecutive scrapes
of one pod make a :class:`Interval` of deltas; an interval where a counter fell (a restart) or the
histograms' buckets changed is left out.

Pure: no clock; reading the file is :func:`read_recording`, the one function with I/O.
"""

from __future__ import annotations

import dataclasses
import gzip
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine import metrics_names as m
from kvpilot.operator.remediation.metrics import Histogram, histogram_from_parts
from kvpilot.operator.remediation.replay import Record, ReplayError, read_records

# Histograms (summed over series) and counters the plan reads.
HISTOGRAMS = (
    m.ITERATION_TOKENS_TOTAL,
    m.TIME_TO_FIRST_TOKEN_SECONDS,
    m.INTER_TOKEN_LATENCY_SECONDS,
    m.REQUEST_PROMPT_TOKENS,
    m.REQUEST_GENERATION_TOKENS,
    m.E2E_REQUEST_LATENCY_SECONDS,
    m.ENGINE_STEP_TIME_RATIO,
    m.ENGINE_ARRIVAL_GAP_SECONDS,
    m.ENGINE_METRICS_RENDER_SECONDS,
    m.ENGINE_REQUEST_INTAKE_SECONDS,
)
COUNTERS = (
    m.REQUEST_SUCCESS_TOTAL,
    m.GENERATION_TOKENS_TOTAL,
    m.NUM_PREEMPTIONS_TOTAL,
    m.PREFIX_CACHE_QUERIES_TOTAL,
    m.PREFIX_CACHE_HITS_TOTAL,
)
GAUGES = (m.NUM_REQUESTS_RUNNING, m.NUM_REQUESTS_WAITING, m.NUM_REQUESTS_SWAPPED, m.KV_CACHE_USAGE_PERC)


class RecordingError(ValueError):
    """The recording cannot be used for a plan; the message says why (one line)."""


@dataclasses.dataclass(frozen=True)
class PlanScrape:
    """One pod's scrape at ``time``: ``counters`` / ``gauges`` by metric name (absent when not
    exported), ``histograms`` likewise, ``cache_info`` the labels of ``vllm:cache_config_info``,
    ``pool_info`` those of ``kvpilot_kv_pool_info`` (kvpilot's engine only: what its pool was sized from)."""

    time: float
    pod: str
    counters: Mapping[str, float]
    gauges: Mapping[str, float]
    histograms: Mapping[str, Histogram]
    cache_info: Mapping[str, str]
    pool_info: Mapping[str, str] = dataclasses.field(default_factory=dict)  # kvpilot_kv_pool_info
    # kvpilot's engine only: its step counters (m.ENGINE_STEP_COUNTERS, in that order) by
    # (phase, batch class), summed over the ``engine`` labels.
    step_counters: Mapping[tuple[str, str], tuple[float, ...]] = dataclasses.field(default_factory=dict)
    # Which of several recordings laid end to end (``read_recordings``) the scrape is from, and the
    # seconds its time was moved by to follow the one before (0 for the first, or a lone recording).
    segment: int = 0
    shift_s: float = 0.0

    @property
    def key(self) -> tuple[int, str]:
        """The pod as the recordings tell it apart: the same name in two recordings is two pods."""
        return (self.segment, self.pod)

    @property
    def in_flight(self) -> float | None:
        """Requests the engine holds (running + waiting + swapped), None without the gauges."""
        if m.NUM_REQUESTS_RUNNING not in self.gauges or m.NUM_REQUESTS_WAITING not in self.gauges:
            return None
        return sum(self.gauges.get(name, 0.0) for name in GAUGES[:3])


@dataclasses.dataclass(frozen=True)
class Interval:
    """What one pod did between two consecutive scrapes: ``start``..``end`` (unix seconds), the
    counter and histogram increases, and the gauges at both ends."""

    pod: str
    start: float
    end: float
    counters: Mapping[str, float]
    histograms: Mapping[str, Histogram]
    before: PlanScrape
    after: PlanScrape
    # The step counters' increases by (phase, batch class), as in PlanScrape.step_counters.
    step_counters: Mapping[tuple[str, str], tuple[float, ...]] = dataclasses.field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def key(self) -> tuple[int, str]:
        return self.before.key


def _samples(metrics: Any) -> Iterable[tuple[str, dict[str, str], float]]:
    if isinstance(metrics, str):
        for family in text_string_to_metric_families(metrics):
            for s in family.samples:
                yield s.name, dict(s.labels), float(s.value)
    elif isinstance(metrics, dict):
        for name, value in metrics.items():
            yield str(name), {}, float(value)
    else:
        for item in metrics:
            if isinstance(item, dict):
                yield str(item["name"]), dict(item.get("labels") or {}), float(item["value"])
            else:
                name, labels, value = item
                yield str(name), dict(labels or {}), float(value)


# kvpilot's step counters, by name: their place in PlanScrape.step_counters' tuples.
_STEP_INDEX = {name: i for i, name in enumerate(m.ENGINE_STEP_COUNTERS)}

# Gauges bounded above as well (a fraction).
_AT_MOST_ONE = (m.KV_CACHE_USAGE_PERC,)


def _label_text(labels: Mapping[str, str]) -> str:
    return "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else ""


def parse_plan_scrape(record: Record) -> PlanScrape:
    """The plan's view of one record's metrics. Raises RecordingError for a body that is not
    Prometheus text (or parsed samples), and for one holding samples no healthy engine exports (a
    NaN, a negative count, a KV usage above 1, a histogram whose buckets are not cumulative): as the
    policy refuses to act on them, no plan is built on them."""
    counters: dict[str, float] = {}
    gauges: dict[str, float] = {}
    parts: dict[str, dict[str, Any]] = {}
    cache_info: dict[str, str] = {}
    pool_info: dict[str, str] = {}
    steps: dict[tuple[str, str], list[float]] = {}
    invalid: list[str] = []
    try:
        for name, labels, value in _samples(record.metrics):
            canonical = m.canonical_name(name)
            part_of = m.canonical_name(name.rsplit("_", 1)[0])  # a histogram's, for its samples
            step_index = _STEP_INDEX.get(name)
            read = (
                canonical in COUNTERS
                or canonical in GAUGES
                or part_of in HISTOGRAMS
                or step_index is not None
            )
            if read and not (math.isfinite(value) and value >= 0):
                invalid.append(f"{name}{_label_text(labels)}={value:g}")
                continue
            if canonical in _AT_MOST_ONE and value > 1:
                invalid.append(f"{name}{_label_text(labels)}={value:g}")
                continue
            if step_index is not None:
                key = (labels.get(m.LABEL_PHASE, ""), labels.get(m.LABEL_NUM_SEQS, ""))
                steps.setdefault(key, [0.0] * len(m.ENGINE_STEP_COUNTERS))[step_index] += value
            elif canonical in COUNTERS:
                counters[canonical] = counters.get(canonical, 0.0) + value
            elif canonical in GAUGES:
                gauges[canonical] = gauges.get(canonical, 0.0) + value
            elif name == m.CACHE_CONFIG_INFO:
                cache_info = labels
            elif name == m.KV_POOL_INFO:
                pool_info = labels
            elif "_" in name:
                base, part = name.rsplit("_", 1)
                histogram = m.canonical_name(base)
                if histogram not in HISTOGRAMS or part not in ("bucket", "sum", "count"):
                    continue
                entry = parts.setdefault(histogram, {"buckets": {}})
                if part == "bucket":
                    le = float(labels["le"])
                    entry["buckets"][le] = entry["buckets"].get(le, 0.0) + value
                else:
                    entry[part] = entry.get(part, 0.0) + value
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise RecordingError(f"{record.pod} at {record.time}: unreadable metrics ({exc})") from exc
    histograms = {}
    for name, entry in parts.items():
        if any(math.isnan(le) for le in entry["buckets"]):
            invalid.append(f"{name}: a bucket bound that is not a number")
            continue
        histogram = histogram_from_parts(name, entry)  # the policy's own check of a histogram
        if isinstance(histogram, str):
            invalid.append(histogram)
        else:
            histograms[name] = histogram
    if invalid:
        more = f" (and {len(invalid) - 1} more)" if len(invalid) > 1 else ""
        raise RecordingError(
            f"{record.pod} at {record.time:.3f}: samples no healthy engine exports, which the policy "
            f"refuses to act on, so no plan is built on them: {invalid[0]}{more}"
        )
    step_counters = {key: tuple(values) for key, values in steps.items()}
    return PlanScrape(
        record.time, record.pod, counters, gauges, histograms, cache_info, pool_info, step_counters
    )


def intervals_of(scrapes: Iterable[PlanScrape]) -> list[Interval]:
    """Consecutive scrapes of each pod, as intervals of increases (in time order). An interval where
    a counter fell or a histogram's buckets do not line up (a restart) is left out."""
    by_pod: dict[tuple[int, str], list[PlanScrape]] = {}
    for scrape in scrapes:
        by_pod.setdefault(scrape.key, []).append(scrape)
    out = []
    for (_, pod), series in by_pod.items():
        series.sort(key=lambda s: s.time)
        for before, after in zip(series, series[1:], strict=False):
            if after.time <= before.time:
                continue
            counters = {
                name: after.counters[name] - before.counters[name]
                for name in COUNTERS
                if name in after.counters and name in before.counters
            }
            if any(v < 0 for v in counters.values()):
                continue  # restarted
            histograms = {}
            for name in HISTOGRAMS:
                if name in after.histograms and name in before.histograms:
                    delta = after.histograms[name].increase(before.histograms[name])
                    if delta is not None:
                        histograms[name] = delta
            if any(name in after.histograms and name not in histograms for name in before.histograms):
                continue  # a histogram fell: restarted
            steps = {
                key: tuple(
                    a - b for a, b in zip(after.step_counters[key], before.step_counters[key], strict=True)
                )
                for key in after.step_counters.keys() & before.step_counters.keys()
            }
            if any(v < 0 for values in steps.values() for v in values):
                continue  # restarted
            out.append(Interval(pod, before.time, after.time, counters, histograms, before, after, steps))
    return sorted(out, key=lambda i: (i.start, i.key))


def read_recording(path: str | Path, isvc: dict[str, Any] | None = None) -> list[PlanScrape]:
    """The usable scrapes of a recording file (``.gz``: gzip-compressed), those of ``isvc`` when the
    lines name their InferenceService; ready pods' successful scrapes only. Raises RecordingError
    (one line) for a file that cannot be read or holds no usable scrape."""
    path = Path(path)
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8") as handle:
            records = read_records(handle, isvc)
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise RecordingError(f"cannot read the recording {path}: {exc}") from exc
    except ReplayError as exc:
        raise RecordingError(f"{path}: {exc}") from exc
    scrapes = [parse_plan_scrape(r) for r in records if r.ready and r.error is None and r.metrics is not None]
    if not scrapes:
        raise RecordingError(f"{path}: no successful scrape of a ready pod")
    return scrapes


def read_recordings(paths: Sequence[str | Path], isvc: dict[str, Any] | None = None) -> list[PlanScrape]:
    """Several recordings of one service as one: laid end to end in the order of their first scrape,
    each moved in time to start where the one before it ends (``PlanScrape.shift_s``), its pods told
    apart from the others' (``PlanScrape.segment``: a pod restarts between recordings, and no
    interval spans two). Quiet stretches within a recording stay; none is added between two. A
    longer stretch of the same traffic for the plan: more requests behind each quantile, and the
    engine's speed over several stretches of the node rather than one. Raises RecordingError for
    recordings that overlap in time (a recording already holds every pod of its service)."""
    parts = [(read_recording(path, isvc), Path(path)) for path in paths]
    parts.sort(key=lambda part: min(s.time for s in part[0]))
    if not parts:
        raise RecordingError("no recording given")
    pools = {path: _pool_labels(scrapes) for scrapes, path in parts}
    if len({pool for pool in pools.values() if pool is not None}) > 1:
        shown = "; ".join(f"{path}: {pool[0]} blocks of {pool[1]}" for path, pool in pools.items() if pool)
        raise RecordingError(
            f"the recordings ran on different KV pools ({shown}): lay end to end only recordings of "
            "the same settings"
        )
    out: list[PlanScrape] = []
    at = min(s.time for s in parts[0][0])
    previous: tuple[float, Path] | None = None
    for segment, (scrapes, path) in enumerate(parts):
        first, last = min(s.time for s in scrapes), max(s.time for s in scrapes)
        if previous is not None and first < previous[0]:
            raise RecordingError(
                f"{path} overlaps {previous[1]} in time: give recordings of different stretches (one "
                "recording holds every pod of its service)"
            )
        shift = at - first
        out += [dataclasses.replace(s, time=s.time + shift, segment=segment, shift_s=shift) for s in scrapes]
        at, previous = last + shift, (last, path)
    return out


def _pool_labels(scrapes: Sequence[PlanScrape]) -> tuple[str, str] | None:
    """The KV pool's block count and size in a recording's newest scrape that carries them."""
    for scrape in sorted(scrapes, key=lambda s: s.time, reverse=True):
        if "num_gpu_blocks" in scrape.cache_info and "block_size" in scrape.cache_info:
            return scrape.cache_info["num_gpu_blocks"], scrape.cache_info["block_size"]
    return None


def segment_spans(scrapes: Iterable[PlanScrape]) -> list[tuple[float, float, float]]:
    """Each recording's span as it was recorded (first and last scrape, unix seconds) and the seconds
    its scrapes were moved by (``read_recordings``), in segment order."""
    spans: dict[int, tuple[float, float, float]] = {}
    for s in scrapes:
        t = s.time - s.shift_s
        lo, hi, _ = spans.get(s.segment, (t, t, s.shift_s))
        spans[s.segment] = (min(lo, t), max(hi, t), s.shift_s)
    return [spans[k] for k in sorted(spans)]
