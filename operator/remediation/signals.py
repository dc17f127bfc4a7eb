"""What a window of metrics says, for the policy: a preemption storm, demand, idleness, and the one
line that describes it (every decision's reason starts with it).

Pure, like the policy. A storm is judged on counts, since a preemption counter moves in whole steps
(:func:`storm_parts`); gauges (KV usage, queue) must hold at every scrape.
"""

from __future__ import annotations

import dataclasses

from kvpilot.operator.api.settings import RemediationSettings
from kvpilot.operator.remediation.window import MetricWindow

# How a storm must cover its window (storm_parts).
STORM_MIN_PARTS = 4  # the window is judged in at least this many consecutive parts...
STORM_EVENTS_PER_PART = 8  # ...and in one more per 8 preemptions it holds, down to one scrape interval
STORM_PART_FLOOR = 0.5  # a part's rate must reach this fraction of preemptionRate...
STORM_PART_MIN_EXPECTED = 2.0  # ...unless that rate expects fewer preemptions in it: then it needs one


@dataclasses.dataclass(frozen=True)
class StormParts:
    """A full window's scrape intervals in consecutive parts, oldest first: each part's preemption
    rate per replica, its length, and whether it reaches its floor."""

    rates: tuple[float, ...]
    seconds: tuple[float, ...]
    one_event: tuple[bool, ...]  # the part's floor is one preemption, not a rate
    reached: tuple[bool, ...]
    floor: float  # preemptions/s per replica, for the parts judged by rate

    @property
    def covered(self) -> bool:
        return bool(self.reached) and all(self.reached)

    def describe(self) -> str:
        k = len(self.rates)
        if not k:
            return "no intervals"
        size = f"{k} parts of {sum(self.seconds) / k:.0f}s"
        lowest = min(self.rates)
        if all(self.one_event):
            missing = self.reached.count(False)
            return f"{size}, " + (f"{missing} without a preemption" if missing else "each with a preemption")
        floor = f"{self.floor:.3g}/s" + (" or one preemption" if any(self.one_event) else "")
        if self.covered:
            return f"{size}, every one >= {floor} (lowest {lowest:.3g}/s)"
        return f"{size}, {self.reached.count(False)} below {floor} (lowest {lowest:.3g}/s)"


def storm_parts(window: MetricWindow, threshold: float) -> StormParts:
    """Whether the window's preemptions cover it: the "sustained" half of the storm test.

    The scrape intervals are split into ``k`` consecutive parts of (nearly) equal count, where ``k`` is
    ``STORM_MIN_PARTS`` (4), or one part per ``STORM_EVENTS_PER_PART`` (8) preemptions in the window
    (all pods) when that is more, and at most the number of intervals. Each part's rate per replica
    must reach ``STORM_PART_FLOOR`` (half) of ``threshold``; a part in which ``threshold`` would expect
    fewer than ``STORM_PART_MIN_EXPECTED`` (2) preemptions (all pods) must hold at least one instead.

    Why: a counter moves in whole steps, so a storm near the threshold shows some scrape interval
    below it almost always; whole parts of the window hold enough counts to see through that noise.
    More preemptions buy finer parts, so a strong storm that began inside the window (its oldest
    intervals calm) or a burst that fills a quarter of it is told apart from one that fills it.
    """
    intervals = window.intervals
    n, pods = len(intervals), max(len(window.pods), 1)
    k = min(n, max(STORM_MIN_PARTS, int(window.num_preemptions // STORM_EVENTS_PER_PART)))
    floor = STORM_PART_FLOOR * threshold
    rates, seconds, one_event, reached = [], [], [], []
    for j in range(k):
        part = intervals[j * n // k : (j + 1) * n // k]
        length = sum(i.seconds for i in part)
        events = pods * sum(i.preemption_rate * i.seconds for i in part)  # preemptions, all pods
        rate = events / (pods * length) if length > 0 else 0.0
        by_event = threshold * length * pods < STORM_PART_MIN_EXPECTED
        rates.append(rate)
        seconds.append(length)
        one_event.append(by_event)
        reached.append(events >= 0.5 if by_event else rate >= floor)
    return StormParts(tuple(rates), tuple(seconds), tuple(one_event), tuple(reached), floor)


def describe(window: MetricWindow, s: RemediationSettings) -> str:
    """The window's signals in one line (decision reasons start with it)."""
    parts = storm_parts(window, s.preemption_rate).describe()
    full = "" if window.full else ", window not full yet"
    return (
        f"{window.preemption_rate:.3g} preemptions/s per replica over {window.covered_s:.0f}s "
        f"({parts}{full}; threshold {s.preemption_rate:g}), KV cache {window.kv_usage:.0%} "
        f"(peak {window.kv_usage_max:.0%}), {window.waiting:.1f} waiting and {window.running:.1f} "
        f"running per replica, {len(window.pods)} pod(s)"
    )


def is_storm(window: MetricWindow, s: RemediationSettings) -> bool:
    """Over a full window, more than ``preemptionRate`` preemptions/s per replica (the window's
    increase over its length), covering the window (:func:`storm_parts`)."""
    return (
        window.full
        and bool(window.intervals)
        and window.preemption_rate > s.preemption_rate
        and storm_parts(window, s.preemption_rate).covered
    )


def is_demand(window: MetricWindow, s: RemediationSettings) -> bool:
    """KV usage >= ``kvCacheUsageHigh`` and >= ``requestsWaitingHigh`` waiting per replica at the end
    of every scrape interval of a full window."""
    return (
        window.full
        and bool(window.intervals)
        and all(i.kv_usage >= s.kv_usage_high and i.waiting >= s.waiting_high for i in window.intervals)
    )


def is_idle(window: MetricWindow, s: RemediationSettings) -> bool:
    """Over a full window: no preemption, no request waiting and KV usage below ``kvCacheUsageIdle``
    at every scrape."""
    return (
        window.full
        and window.num_preemptions == 0
        and window.waiting_max == 0
        and window.kv_usage_max < s.kv_usage_idle
    )
