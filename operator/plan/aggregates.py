"""What a recording's intervals and scrapes add up to, for ``workload.workload_from_scrapes``
(torch-free): the prefix-cache hit rate, histograms over the whole recording, whether the engine
paced its clients, their peak concurrency and their turnaround."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from kvpilot.engine import metrics_names as m
from kvpilot.operator.plan.recording import Interval, PlanScrape
from kvpilot.operator.remediation.metrics import Histogram

SATURATED_FRACTION = 0.9  # of the scrapes with a queue (or near the peak): the engine paced the clients
# A pod "near its peak" holds at least this share of the most requests it ever held: a closed-loop
# client between two of its requests (the answer read, the next one not yet in) is not in flight.
NEAR_PEAK = 0.75


def _peaks(scrapes: Iterable[PlanScrape]) -> dict[tuple[int, str], float]:
    """The most requests each pod held in flight at any of ``scrapes`` that report it."""
    peaks: dict[tuple[int, str], float] = {}
    for scrape in scrapes:
        if scrape.in_flight is not None:
            peaks[scrape.key] = max(peaks.get(scrape.key, 0.0), scrape.in_flight)
    return peaks


def _segments(scrapes: Iterable[PlanScrape]) -> list[list[PlanScrape]]:
    """The scrapes of each recording laid end to end (``recording.read_recordings``), in order."""
    out: dict[int, list[PlanScrape]] = {}
    for scrape in scrapes:
        out.setdefault(scrape.segment, []).append(scrape)
    return [out[k] for k in sorted(out)]


def _near_peak(in_flight: float | None, peak: float) -> bool:
    """Whether a pod holding ``in_flight`` requests is near its ``peak`` (``NEAR_PEAK``)."""
    return peak >= 1 and in_flight is not None and in_flight >= math.ceil(NEAR_PEAK * peak)


def prefix_hit_rate(intervals: Sequence[Interval]) -> float | None:
    """Prompt tokens found in the prefix cache over those looked up, over the intervals that count
    both (None: no lookup)."""
    both = (m.PREFIX_CACHE_QUERIES_TOTAL, m.PREFIX_CACHE_HITS_TOTAL)
    counted = [[i.counters[n] for n in both] for i in intervals if all(n in i.counters for n in both)]
    queries, hits = (sum(c[k] for c in counted) for k in (0, 1))
    return min(1.0, hits / queries) if queries > 0 else None


def summed(intervals: Sequence[Interval], name: str) -> Histogram | None:
    """Histogram ``name`` over every interval that has it (None: none has; intervals whose bucket
    bounds differ from the first's, as after an upgrade, are left out)."""
    total: Histogram | None = None
    for interval in intervals:
        h = interval.histograms.get(name)
        if h is None:
            continue
        if total is None:
            total = h
        elif h.bounds == total.bounds:
            total = total + h
    return total


def mean_of(intervals: Sequence[Interval], name: str) -> float | None:
    """The mean observation of histogram ``name`` over the intervals, None without observations."""
    count = total = 0.0
    for interval in intervals:
        h = interval.histograms.get(name)
        if h is not None and h.count > 0:
            count += h.count
            total += h.sum
    return total / count if count > 0 else None


def client_turnaround(intervals: Sequence[Interval]) -> float:
    """The mean time a closed-loop client spends between one request's end and its next one reaching
    the engine, from the stretches where a pod held nearly its peak number of requests at both ends
    of an interval: its clients (the peak) each cycle through a request's latency and a turnaround,
    so ``peak * seconds / finished`` (a cycle) less the mean ``vllm:e2e_request_latency_seconds`` of
    those requests is the turnaround (Little's law). 0 without such stretches or latencies, and
    never negative (a pod whose peak was briefly exceeded by backlog reads as turning round at once)."""
    peaks = _peaks(s for interval in intervals for s in (interval.before, interval.after))
    client_seconds = finished = latency_sum = latency_count = 0.0
    for interval in intervals:
        peak = peaks.get(interval.key, 0.0)
        ends = (interval.before.in_flight, interval.after.in_flight)
        e2e = interval.histograms.get(m.E2E_REQUEST_LATENCY_SECONDS)
        done = interval.counters.get(m.REQUEST_SUCCESS_TOTAL, 0.0)
        if e2e is None or e2e.count <= 0 or done <= 0 or not all(_near_peak(n, peak) for n in ends):
            continue
        client_seconds += peak * interval.seconds
        finished += done
        latency_sum += e2e.sum
        latency_count += e2e.count
    if finished <= 0 or latency_count <= 0:
        return 0.0
    return max(0.0, client_seconds / finished - latency_sum / latency_count)


def saturated(scrapes: Sequence[PlanScrape]) -> bool:
    """Whether the engine paced the clients: at (nearly) every scrape that reports the gauges, a
    request waited, or every pod held nearly as many requests as it ever did (closed-loop clients,
    all but a few of them waiting on the engine). Recordings laid end to end count together, each
    over its own span with traffic."""
    counted = paced = 0
    for segment in _segments(scrapes):
        n, k = _paced_scrapes(segment)
        counted, paced = counted + n, paced + k
    return counted > 0 and paced >= SATURATED_FRACTION * counted


def _paced_scrapes(scrapes: Sequence[PlanScrape]) -> tuple[int, int]:
    """One recording's scrapes with traffic, and how many of them show a queue (or, if more, how
    many show the pods near their peak)."""
    counted = sorted((s for s in scrapes if s.in_flight is not None), key=lambda s: s.time)
    # Only the span with traffic: not the idle scrapes before the first request or after the last.
    busy = [i for i, s in enumerate(counted) if (s.in_flight or 0.0) > 0]
    if not busy:
        return 0, 0
    counted = counted[busy[0] : busy[-1] + 1]
    peaks = _peaks(counted)
    queued = sum(s.gauges[m.NUM_REQUESTS_WAITING] >= 1 for s in counted)
    near_peak = sum(_near_peak(s.in_flight, peaks[s.key]) for s in counted)
    return len(counted), max(queued, near_peak)


def peak_in_flight(scrapes: Sequence[PlanScrape]) -> int | None:
    """The clients' concurrency: the sum over pods of the most requests each held in flight (the most
    of any recording, where several are laid end to end)."""
    total = max(round(sum(_peaks(segment).values())) for segment in _segments(scrapes)) if scrapes else 0
    return total if total > 0 else None
