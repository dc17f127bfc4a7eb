"""The window the remediation policy reads: every ready pod's series reduced to one
:class:`MetricWindow` by :func:`summarize`.

Pure: no I/O and no clock. The window keeps each interval between two consecutive scrapes
(``MetricWindow.intervals``: its length, the preemption rate over it and the gauges at its end, per
replica), so that the policy can judge not only the window's totals but how they spread over it
(``signals.storm_parts``: a storm must cover the window; gauges must hold at every scrape). A window
is ``full`` when every pod has a scrape at or before its start, so the intervals cover all of it. A
window is complete (the policy may act on it) with at least three scrapes (``MIN_SAMPLES``) spanning
at least ``MIN_COVERAGE`` of it and no gap between two of them longer than the staleness bound.

Nothing is inferred from data that is missing, stale, partial, invalid or unparsable: each such case
becomes a line in ``MetricWindow.problems``, and the policy never acts on a window with problems.

Latency (``MetricWindow.ttft_p99_s``, ``queue_time_s``): the increase of each pod's
``vllm:time_to_first_token_seconds`` and ``vllm:request_queue_time_seconds`` histograms between the
window's first and last scrape, summed over the pods, interval by interval; across a counter reset
(``Point.restarted``) the increase is what the new process counted, as for preemptions. They are
optional, and unknown (None) unless every pod exports them at every scrape of the window with valid
data: a histogram dropped as invalid, or one that fell without a restart, is named in
``MetricWindow.latency_invalid`` and never used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

from kvpilot.engine import metrics_names as m
from kvpilot.operator.remediation.metrics import (
    Capacity,
    Histogram,
    ModelShape,
    Scrape,
    capacity_of,
    histogram_quantile,
    shape_of,
)
from kvpilot.operator.remediation.pods import Failure
from kvpilot.operator.remediation.series import PodSeries, Point

# A window is complete when its samples span at least this fraction of it.
MIN_COVERAGE = 0.9
MIN_SAMPLES = 3
# The TTFT quantile the SLO bounds (spec.remediation.slo.ttftP99Seconds).
TTFT_QUANTILE = 0.99


@dataclasses.dataclass(frozen=True)
class Interval:
    """One scrape interval of the window, per replica (mean over the pods): the preemption rate over
    it, KV usage and queue at its end, and its length in seconds."""

    preemption_rate: float
    kv_usage: float
    waiting: float
    seconds: float


@dataclasses.dataclass(frozen=True)
class MetricWindow:
    """The ready engine pods' metrics over the window ending at ``end`` (per replica: mean over pods).

    ``problems`` lists why the data cannot be acted upon (empty: complete and fresh). ``failing``:
    the :class:`~kvpilot.operator.remediation.pods.Failure` of pods of the current configuration that
    crash, were OOM-killed or cannot be scheduled. ``intervals``: the scrape intervals, oldest first
    (the "sustained" test); ``full``: they cover the whole window for every pod.
    """

    end: float
    window_s: float
    pods: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    failing: tuple[Failure, ...] = ()
    start: float | None = None
    preemption_rate: float = 0.0
    num_preemptions: float = 0.0
    kv_usage: float = 0.0
    kv_usage_max: float = 0.0
    waiting: float = 0.0
    waiting_max: float = 0.0
    running: float = 0.0
    intervals: tuple[Interval, ...] = ()
    full: bool = False
    counter_resets: int = 0
    capacity: Capacity | None = None
    shape: ModelShape | None = None
    mean_request_tokens: float | None = None  # prompt + output tokens of the requests finished in it
    ttft_p99_s: float | None = None  # TTFT p99 of the requests whose first token came in it
    num_first_tokens: float = 0.0  # how many requests got their first token in it (all pods)
    queue_time_s: float | None = None  # mean queue time of the requests scheduled in it
    latency_invalid: tuple[str, ...] = ()  # latency histograms not used because their data is invalid

    @property
    def not_running(self) -> tuple[Failure, ...]:
        """The failing pods that do not serve (a ready pod with a recent OOM kill serves)."""
        return tuple(f for f in self.failing if not f.ready)

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
    intervals: list[Interval]  # oldest first
    full: bool  # a scrape at or before the window start: the intervals cover the whole window
    finished: float = 0.0  # requests finished over the window (0: unknown, or a restart in it)
    finished_tokens: float = 0.0  # their prompt + output tokens
    ttft: Histogram | str | None = None  # the increase over the window; str: invalid (why); None: absent
    queue_time: Histogram | str | None = None


def _finished(first: Scrape, last: Scrape) -> tuple[float, float]:
    """Requests finished between two scrapes of one process, and their tokens ((0, 0): unknown)."""
    values = (first.requests_finished, first.request_tokens, last.requests_finished, last.request_tokens)
    if None in values or first.started != last.started:
        return 0.0, 0.0
    count = last.requests_finished - first.requests_finished
    tokens = last.request_tokens - first.request_tokens
    return (count, tokens) if count > 0 and tokens >= 0 else (0.0, 0.0)


def _increase(
    points: list[Point], name: str, get: Callable[[Scrape], Histogram | None]
) -> Histogram | str | None:
    """A latency histogram's increase over ``points`` (one pod's scrapes, oldest first), interval by
    interval; across a counter reset, what the new process counted. None when a scrape lacks it (not
    exported); why, when its data is invalid (dropped by the reader, or a fall without a restart)."""
    total: Histogram | None = None
    for a, b in zip(points, points[1:], strict=False):
        before, after = get(a.scrape), get(b.scrape)
        if before is None or after is None:
            dropped = [d for p in (a, b) for d in p.scrape.dropped if d.startswith(name + ":")]
            return dropped[0] if dropped else None
        step = after if b.restarted else after.increase(before)
        if step is None:
            return f"{name}: fell without a restart, or its buckets changed"
        if total is not None and total.bounds != step.bounds:
            return f"{name}: its buckets changed across a restart"
        total = step if total is None else total + step
    return total


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
    intervals = [
        Interval(
            preemption_rate=(b.preemptions - a.preemptions) / max(b.scrape.time - a.scrape.time, 1e-9),
            kv_usage=b.scrape.kv_usage or 0.0,
            waiting=b.scrape.waiting or 0.0,
            seconds=b.scrape.time - a.scrape.time,
        )
        for a, b in zip(used, used[1:], strict=False)
    ]
    finished, finished_tokens = _finished(first.scrape, last.scrape)
    return _PodWindow(
        name=series.name,
        start=first.scrape.time,
        end=last.scrape.time,
        increase=last.preemptions - first.preemptions,
        kv=[(p.scrape.time, p.scrape.kv_usage or 0.0) for p in inside],
        waiting=[(p.scrape.time, p.scrape.waiting or 0.0) for p in inside],
        running=[p.scrape.running or 0.0 for p in inside],
        intervals=intervals,
        full=first.scrape.time <= begin,
        finished=finished,
        finished_tokens=finished_tokens,
        ttft=_increase(used, m.TIME_TO_FIRST_TOKEN_SECONDS, lambda scrape: scrape.ttft),
        queue_time=_increase(used, m.REQUEST_QUEUE_TIME_SECONDS, lambda scrape: scrape.queue_time),
    )


def summarize(
    series: Mapping[str, PodSeries],
    *,
    now: float,
    window_s: float,
    stale_after_s: float,
    expected_replicas: int | None = None,
    problems: Iterable[str] = (),
    failing: Iterable[Failure | str] = (),
) -> MetricWindow:
    """Reduce the series of the pods that should report (``series``: pod name -> series) to a window.

    ``expected_replicas``: how many ready pods of the current configuration there should be (None:
    whoever is in ``series``, as in a replay). ``problems`` / ``failing``: what the caller found
    already (pods not ready, pods on an outdated configuration, crashing pods; a ``"pod: why"`` string
    is a failure of unknown time).
    """
    found = list(problems)
    failing = tuple(f if isinstance(f, Failure) else Failure(*str(f).partition(": ")[::2]) for f in failing)
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
        if pod.problem is not None:
            found.append(f"pod {name}: bad data in the latest scrape: {pod.problem}")
            continue
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
    # Pods are scraped together, once per tick: their k-th interval from the newest covers the same time.
    intervals = []
    for back in range(1, max(len(w.intervals) for w in windows) + 1):
        same = [w.intervals[-back] for w in windows if len(w.intervals) >= back]
        intervals.append(
            Interval(
                preemption_rate=_mean(i.preemption_rate for i in same),
                kv_usage=_mean(i.kv_usage for i in same),
                waiting=_mean(i.waiting for i in same),
                seconds=_mean(i.seconds for i in same),
            )
        )
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
        intervals=tuple(reversed(intervals)),
        full=all(w.full for w in windows),
        counter_resets=resets,
        capacity=capacity,
        shape=shape,
        mean_request_tokens=_mean_request_tokens(windows),
        **_latency(windows),
    )


def _summed(pods: list[tuple[str, Histogram | str | None]], invalid: list[str]) -> Histogram | None:
    """The pods' increases summed, or None when one lacks it (its reason added to ``invalid`` when it
    is invalid data) or the pods' bucket bounds disagree."""
    total: Histogram | None = None
    for name, value in pods:
        if isinstance(value, str):
            invalid.append(f"pod {name}: {value}")
            return None
        if value is None:
            return None
        if total is not None and total.bounds != value.bounds:
            invalid.append(f"pod {name}: its latency buckets differ from the other pods'")
            return None
        total = value if total is None else total + value
    return total


def _latency(windows: list[_PodWindow]) -> dict:
    """The window's TTFT p99, first tokens, mean queue time and the invalid latency data (fields of
    :class:`MetricWindow`)."""
    invalid: list[str] = []
    ttft = _summed([(w.name, w.ttft) for w in windows], invalid)
    queue = _summed([(w.name, w.queue_time) for w in windows], invalid)
    return {
        "ttft_p99_s": histogram_quantile(TTFT_QUANTILE, ttft.buckets) if ttft is not None else None,
        "num_first_tokens": ttft.count if ttft is not None else 0.0,
        "queue_time_s": queue.sum / queue.count if queue is not None and queue.count > 0 else None,
        "latency_invalid": tuple(invalid),
    }


def _mean_request_tokens(windows: list[_PodWindow]) -> float | None:
    count = sum(w.finished for w in windows)
    return sum(w.finished_tokens for w in windows) / count if count > 0 else None
