"""Engine metrics over time: one pod's scrapes, and the window the remediation policy reads.

Pure: no I/O and no clock. ``parse_scrape`` turns one ``/metrics`` response (Prometheus text, as the
engine serves it) into a :class:`Scrape`; a :class:`PodSeries` keeps one pod's scrapes and makes its
preemption counter monotonic across restarts; :func:`summarize` reduces every pod's series to the
:class:`MetricWindow` that ``policy.decide`` reads.

Counter resets. A restarted engine starts ``vllm:num_preemptions_total`` at 0 again. A reset is seen
when the value goes down, or when the counter's ``_created`` timestamp changes (which also catches a
restart whose new count already passed the old one between two scrapes). The increase across a reset
is the new value (what the restarted process counted), as in Prometheus' ``increase()``.

"Sustained" means in both halves of the window, not just on average: a single burst of preemptions
that averages above the threshold over the window does not count as a storm. That takes at least three
scrapes per window (``MIN_SAMPLES``), spanning at least ``MIN_COVERAGE`` of it with no gap between two
of them longer than the staleness bound (an average across a hole in the data is not "sustained").

Nothing is inferred from data that is missing, stale, partial or unparsable: each such case becomes a
line in ``MetricWindow.problems``, and the policy never acts on a window with problems.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine import metrics_names as m

# The counter's creation time, exported next to it by prometheus-client (``<name>_created``).
PREEMPTIONS_CREATED = m.NUM_PREEMPTIONS_TOTAL.removesuffix("_total") + "_created"
# What one scrape must carry to count; the names as the engine exports them (aliases accepted).
REQUIRED = (m.NUM_PREEMPTIONS_TOTAL, m.KV_CACHE_USAGE_PERC, m.NUM_REQUESTS_WAITING, m.NUM_REQUESTS_RUNNING)
# A window is complete when its samples span at least this fraction of it.
MIN_COVERAGE = 0.9
MIN_SAMPLES = 3


class MetricsParseError(ValueError):
    """A ``/metrics`` body is not Prometheus text exposition."""


@dataclasses.dataclass(frozen=True)
class Scrape:
    """One pod's ``/metrics`` at ``time`` (unix seconds).

    ``preemptions``: ``vllm:num_preemptions_total`` summed over its series; ``preemptions_created``:
    its ``_created`` timestamp when exported. ``kv_usage`` (0..1), ``waiting``, ``running``: the
    gauges. ``cache_info`` / ``model_info``: the labels of ``vllm:cache_config_info`` and
    ``kvpilot:model_config_info``. ``missing``: required metrics the response lacked.
    """

    time: float
    preemptions: float | None = None
    preemptions_created: float | None = None
    kv_usage: float | None = None
    waiting: float | None = None
    running: float | None = None
    cache_info: Mapping[str, str] = dataclasses.field(default_factory=dict)
    model_info: Mapping[str, str] = dataclasses.field(default_factory=dict)
    missing: tuple[str, ...] = ()


def _samples_from_text(text: str) -> list[tuple[str, dict[str, str], float]]:
    try:
        return [
            (s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text)
            for s in family.samples
        ]
    except Exception as exc:  # the parser raises ValueError, IndexError, ... on garbage
        raise MetricsParseError(f"not Prometheus text exposition: {exc}") from exc


def _samples_from_json(value: Any) -> list[tuple[str, dict[str, str], float]]:
    """Parsed samples as a replay file may hold them: ``{"name": value}`` or a list of
    ``{"name", "labels", "value"}`` objects / ``[name, labels, value]`` triples."""
    out = []
    try:
        if isinstance(value, dict):
            return [(str(k), {}, float(v)) for k, v in value.items()]
        for item in value:
            if isinstance(item, dict):
                out.append((str(item["name"]), dict(item.get("labels") or {}), float(item["value"])))
            else:
                name, labels, number = item
                out.append((str(name), dict(labels or {}), float(number)))
    except (KeyError, TypeError, ValueError) as exc:
        raise MetricsParseError(f"not a list of samples: {exc}") from exc
    return out


def parse_scrape(metrics: str | list | dict, time: float) -> Scrape:
    """A :class:`Scrape` from Prometheus text (or already parsed samples, see ``_samples_from_json``).

    Deprecated names (``vllm:gpu_cache_usage_perc``) count as their current ones; where an engine
    exports both, the current name wins. Raises MetricsParseError for an unparsable body.
    """
    samples = _samples_from_text(metrics) if isinstance(metrics, str) else _samples_from_json(metrics)
    sums: dict[str, float] = {}
    via_alias: dict[str, float] = {}
    cache_info: dict[str, str] = {}
    model_info: dict[str, str] = {}
    created: float | None = None
    for name, labels, value in samples:
        if math.isnan(value):
            continue
        if name == m.CACHE_CONFIG_INFO:
            cache_info = labels
            continue
        if name == m.MODEL_CONFIG_INFO:
            model_info = labels
            continue
        if name == PREEMPTIONS_CREATED:
            created = value if created is None else min(created, value)
            continue
        canonical = m.canonical_name(name)
        if canonical not in REQUIRED:
            continue
        target = sums if canonical == name else via_alias
        if canonical == m.KV_CACHE_USAGE_PERC:  # one pool per engine: several series -> the fullest
            target[canonical] = max(target.get(canonical, 0.0), value)
        else:
            target[canonical] = target.get(canonical, 0.0) + value
    values = {**via_alias, **sums}
    return Scrape(
        time=float(time),
        preemptions=values.get(m.NUM_PREEMPTIONS_TOTAL),
        preemptions_created=created,
        kv_usage=values.get(m.KV_CACHE_USAGE_PERC),
        waiting=values.get(m.NUM_REQUESTS_WAITING),
        running=values.get(m.NUM_REQUESTS_RUNNING),
        cache_info=cache_info,
        model_info=model_info,
        missing=tuple(name for name in REQUIRED if name not in values),
    )


@dataclasses.dataclass(frozen=True)
class _Point:
    scrape: Scrape
    preemptions: float  # cumulative since the series began, resets folded in


class PodSeries:
    """The scrapes of one pod (one pod uid), oldest first, with a reset-proof preemption count.

    ``add`` takes complete scrapes (``missing`` empty) in time order; ``fail`` records a scrape that
    failed (no answer, a bad status, an unparsable or partial body). Samples older than
    ``retention_s`` before the newest are dropped.
    """

    def __init__(self, name: str, retention_s: float = 3600.0) -> None:
        self.name = name
        self.retention_s = retention_s
        self._points: deque[_Point] = deque()
        self.resets: deque[float] = deque()  # times at which a counter reset was seen
        self.last_error: str | None = None
        self.last_error_time: float | None = None

    def add(self, scrape: Scrape) -> None:
        """Append a complete scrape; scrapes not newer than the last one are ignored."""
        if scrape.missing:
            raise ValueError(f"{self.name}: a partial scrape cannot join a series ({scrape.missing})")
        if self._points and scrape.time <= self._points[-1].scrape.time:
            return
        total = 0.0
        if self._points:
            prev = self._points[-1]
            value, before = scrape.preemptions or 0.0, prev.scrape.preemptions or 0.0
            recreated = (
                scrape.preemptions_created is not None
                and prev.scrape.preemptions_created is not None
                and scrape.preemptions_created != prev.scrape.preemptions_created
            )
            if value < before or recreated:
                self.resets.append(scrape.time)
                total = prev.preemptions + value
            else:
                total = prev.preemptions + (value - before)
        self._points.append(_Point(scrape, total))
        self.last_error = None
        horizon = scrape.time - self.retention_s
        while len(self._points) > 2 and self._points[1].scrape.time <= horizon:
            self._points.popleft()
        while self.resets and self.resets[0] <= horizon:
            self.resets.popleft()

    def fail(self, time: float, error: str) -> None:
        """Record a failed scrape; the series keeps its samples (they go stale on their own)."""
        self.last_error = error
        self.last_error_time = time

    @property
    def last(self) -> Scrape | None:
        """The newest complete scrape, or None."""
        return self._points[-1].scrape if self._points else None

    def points(self) -> list[_Point]:
        return list(self._points)


@dataclasses.dataclass(frozen=True)
class Capacity:
    """KV capacity of one engine (``vllm:cache_config_info`` and the model's ``max_model_len``)."""

    num_gpu_blocks: int
    block_size: int
    max_model_len: int | None = None
    explicit_size: bool = False  # num_gpu_blocks_override set: the memory fraction does not size the pool

    @property
    def kv_cache_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    @property
    def max_concurrency(self) -> float | None:
        """How many ``max_model_len``-long requests fit at once."""
        return self.kv_cache_tokens / self.max_model_len if self.max_model_len else None


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What ``kvpilot:model_config_info`` says about the model and the engine's running limits."""

    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    num_hidden_layers: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None


def _int(labels: Mapping[str, str], key: str) -> int | None:
    try:
        return int(labels[key])
    except (KeyError, TypeError, ValueError):
        return None


def capacity_of(scrape: Scrape) -> Capacity | None:
    """The engine's KV capacity from its info metrics, or None when they are absent."""
    blocks, block_size = _int(scrape.cache_info, "num_gpu_blocks"), _int(scrape.cache_info, "block_size")
    if blocks is None or block_size is None:
        return None
    override = scrape.cache_info.get("num_gpu_blocks_override")
    return Capacity(
        num_gpu_blocks=blocks,
        block_size=block_size,
        max_model_len=_int(scrape.model_info, "max_model_len"),
        explicit_size=override not in (None, "", "None"),
    )


def shape_of(scrape: Scrape) -> ModelShape | None:
    """The model shape from ``kvpilot:model_config_info``, or None when absent."""
    if not scrape.model_info:
        return None
    info = scrape.model_info
    return ModelShape(
        num_attention_heads=_int(info, "num_attention_heads"),
        num_key_value_heads=_int(info, "num_key_value_heads"),
        num_hidden_layers=_int(info, "num_hidden_layers"),
        max_num_seqs=_int(info, "max_num_seqs"),
        max_num_batched_tokens=_int(info, "max_num_batched_tokens"),
        max_model_len=_int(info, "max_model_len"),
    )


@dataclasses.dataclass(frozen=True)
class Half:
    """One half of the window, per replica: preemption rate, mean KV usage and queue."""

    preemption_rate: float
    kv_usage: float
    waiting: float


@dataclasses.dataclass(frozen=True)
class MetricWindow:
    """The ready engine pods' metrics over the window ending at ``end`` (per replica: mean over pods).

    ``problems`` lists why the data cannot be acted upon (empty: complete and fresh). ``failing``
    names pods of the current configuration that crash, are OOM-killed or cannot be scheduled.
    ``halves`` are the window's first and second half (the "sustained" test).
    """

    end: float
    window_s: float
    pods: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    failing: tuple[str, ...] = ()
    start: float | None = None
    preemption_rate: float = 0.0
    num_preemptions: float = 0.0
    kv_usage: float = 0.0
    kv_usage_max: float = 0.0
    waiting: float = 0.0
    waiting_max: float = 0.0
    running: float = 0.0
    halves: tuple[Half, ...] = ()
    counter_resets: int = 0
    capacity: Capacity | None = None
    shape: ModelShape | None = None

    @property
    def is_complete(self) -> bool:
        """Whether the policy may act on this window."""
        return not self.problems and bool(self.pods)

    @property
    def covered_s(self) -> float:
        return self.end - self.start if self.start is not None else 0.0


@dataclasses.dataclass(frozen=True)
class _PodWindow:
    name: str
    start: float
    end: float
    increase: float
    kv: list[tuple[float, float]]  # (time, value)
    waiting: list[tuple[float, float]]
    running: list[float]
    half_increase: tuple[float, float]
    mid: float


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def _pod_window(series: PodSeries, now: float, window_s: float, max_gap_s: float) -> _PodWindow | str:
    points = [p for p in series.points() if p.scrape.time <= now]
    if not points:
        return "no complete scrape yet"
    begin = now - window_s
    # The base is the newest sample at or before the window start, so increases span the window.
    base_index = max((i for i, p in enumerate(points) if p.scrape.time <= begin), default=0)
    used = points[base_index:]
    first, last = used[0], used[-1]
    covered = last.scrape.time - first.scrape.time
    inside = [p for p in used if p.scrape.time > first.scrape.time] or used
    if covered < MIN_COVERAGE * window_s or len(used) < MIN_SAMPLES:
        return (
            f"{len(used)} scrape(s) over {covered:.0f}s of the {window_s:.0f}s window "
            f"(need {MIN_SAMPLES} over {MIN_COVERAGE * window_s:.0f}s)"
        )
    gap = max(b.scrape.time - a.scrape.time for a, b in zip(used, used[1:], strict=False))
    if gap > max_gap_s:
        return f"a gap of {gap:.0f}s between scrapes in the window (more than {max_gap_s:.0f}s)"
    mid = (first.scrape.time + last.scrape.time) / 2
    at_mid = max((p for p in used if p.scrape.time <= mid), key=lambda p: p.scrape.time)
    return _PodWindow(
        name=series.name,
        start=first.scrape.time,
        end=last.scrape.time,
        increase=last.preemptions - first.preemptions,
        kv=[(p.scrape.time, p.scrape.kv_usage or 0.0) for p in inside],
        waiting=[(p.scrape.time, p.scrape.waiting or 0.0) for p in inside],
        running=[p.scrape.running or 0.0 for p in inside],
        half_increase=(at_mid.preemptions - first.preemptions, last.preemptions - at_mid.preemptions),
        mid=at_mid.scrape.time,
    )


def summarize(
    series: Mapping[str, PodSeries],
    *,
    now: float,
    window_s: float,
    stale_after_s: float,
    expected_replicas: int | None = None,
    problems: Iterable[str] = (),
    failing: Iterable[str] = (),
) -> MetricWindow:
    """Reduce the series of the pods that should report (``series``: pod name -> series) to a window.

    ``expected_replicas``: how many ready pods of the current configuration there should be (None:
    whoever is in ``series``, as in a replay). ``problems`` / ``failing``: what the caller found
    already (pods not ready, pods on an outdated configuration, crashing pods).
    """
    found = list(problems)
    failing = tuple(failing)
    if expected_replicas is not None and len(series) != expected_replicas:
        found.append(f"{len(series)} of {expected_replicas} replica(s) ready on the current configuration")
    if not series and expected_replicas is None:
        found.append("no engine pod reports metrics")
    windows: list[_PodWindow] = []
    capacity: Capacity | None = None
    shape: ModelShape | None = None
    resets = 0
    for name in sorted(series):
        pod = series[name]
        last = pod.last
        if last is None or now - last.time > stale_after_s:
            age = "never scraped" if last is None else f"last complete scrape {now - last.time:.0f}s ago"
            error = f" ({pod.last_error})" if pod.last_error else ""
            found.append(f"pod {name}: metrics stale, {age}{error}")
            continue
        result = _pod_window(pod, now, window_s, stale_after_s)
        if isinstance(result, str):
            found.append(f"pod {name}: {result}")
            continue
        windows.append(result)
        resets += sum(1 for t in pod.resets if t > now - window_s)
        pod_capacity, pod_shape = capacity_of(last), shape_of(last)
        if pod_capacity is not None and (
            capacity is None or pod_capacity.num_gpu_blocks < capacity.num_gpu_blocks
        ):
            capacity = pod_capacity  # pods that disagree: plan for the smallest pool
        shape = shape or pod_shape
    if not windows:
        return MetricWindow(
            end=now, window_s=window_s, problems=tuple(found) or ("no data",), failing=failing
        )
    start, end = min(w.start for w in windows), max(w.end for w in windows)
    halves = []
    for index in (0, 1):
        rates, kv, waiting = [], [], []
        for w in windows:
            lo, hi = (w.start, w.mid) if index == 0 else (w.mid, w.end)
            rates.append(w.half_increase[index] / max(hi - lo, 1e-9))
            pick = [(t, v) for t, v in w.kv if (t <= w.mid) == (index == 0)] or w.kv
            kv.append(_mean(v for _, v in pick))
            pick = [(t, v) for t, v in w.waiting if (t <= w.mid) == (index == 0)] or w.waiting
            waiting.append(_mean(v for _, v in pick))
        halves.append(Half(preemption_rate=_mean(rates), kv_usage=_mean(kv), waiting=_mean(waiting)))
    return MetricWindow(
        end=end,
        window_s=window_s,
        pods=tuple(w.name for w in windows),
        problems=tuple(found),
        failing=failing,
        start=start,
        preemption_rate=_mean(w.increase / max(w.end - w.start, 1e-9) for w in windows),
        num_preemptions=sum(w.increase for w in windows),
        kv_usage=_mean(_mean(v for _, v in w.kv) for w in windows),
        kv_usage_max=max(v for w in windows for _, v in w.kv),
        waiting=_mean(_mean(v for _, v in w.waiting) for w in windows),
        waiting_max=max(v for w in windows for _, v in w.waiting),
        running=_mean(_mean(w.running) for w in windows),
        halves=tuple(halves),
        counter_resets=resets,
        capacity=capacity,
        shape=shape,
    )
