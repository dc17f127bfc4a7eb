"""What a window of metrics says, for the policy: a preemption storm, demand, idleness, and the one
line that describes it (every decision's reason starts with it).

Pure, like the policy. A storm is judged on counts, since a preemption counter moves in whole steps
(:func:`storm_parts`); gauges (KV usage, queue) must hold at every scrape.

Demand has two rules (:func:`demand_of`), each with the numbers that made it fire:

- ``kvCache``: KV usage >= ``kvCacheUsageHigh`` and >= ``requestsWaitingHigh`` waiting per replica at
  every scrape: the pool is full and requests queue for it.
- ``ttftSlo`` / ``queueTime``: >= ``requestsWaitingMin`` waiting per replica at every scrape and the
  window's TTFT p99 above ``slo.ttftP99Seconds`` (without an SLO: its mean queue time above
  ``queueTimeHighSeconds``), whatever the KV usage. Long prompts queue behind prefill while the KV cache
  stays far from full (llm-d-autoscaling#662: a growing queue at 32 % KV usage); the latency is the
  evidence, so the queue gate is low. A queue that preemptions feed (the window's rate at
  ``STORM_PART_FLOOR`` of ``preemptionRate`` or more) is left to the storm rule, whose per-pod levers
  come first; no request served in the window, no quantile: the rule does not fire.
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


# Demand rules (Demand.rule).
DEMAND_KV, DEMAND_TTFT, DEMAND_QUEUE_TIME = "kvCache", "ttftSlo", "queueTime"


@dataclasses.dataclass(frozen=True)
class Demand:
    """Which demand rule fired (``DEMAND_KV``, ``DEMAND_TTFT`` or ``DEMAND_QUEUE_TIME``) and, for
    people, the numbers it fired on."""

    rule: str
    message: str


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
    latency = []
    if window.ttft_p99_s is not None:
        latency.append(f"TTFT p99 {window.ttft_p99_s:.3g}s over {window.num_first_tokens:.0f} request(s)")
    if window.queue_time_s is not None:
        latency.append(f"mean queue time {window.queue_time_s:.3g}s")
    if window.latency_invalid:
        latency.append(f"latency data not used ({'; '.join(window.latency_invalid)})")
    return (
        f"{window.preemption_rate:.3g} preemptions/s per replica over {window.covered_s:.0f}s "
        f"({parts}{full}; threshold {s.preemption_rate:g}), KV cache {window.kv_usage:.0%} "
        f"(peak {window.kv_usage_max:.0%}), {window.waiting:.1f} waiting and {window.running:.1f} "
        f"running per replica, {len(window.pods)} pod(s)" + "".join(f", {part}" for part in latency)
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


def demand_of(window: MetricWindow, s: RemediationSettings) -> Demand | None:
    """The demand a full window shows, or None: the ``kvCache`` rule first, then the latency rule
    (``ttftSlo`` with an SLO, ``queueTime`` without), as the module describes them. Gauges are read at
    the end of every scrape interval; latency over the whole window (``MetricWindow.ttft_p99_s``,
    ``queue_time_s``: None when unknown or invalid, and then the latency rule does not fire)."""
    if not window.full or not window.intervals:
        return None
    kv = f"KV cache {window.kv_usage:.0%}"
    lowest = min(i.waiting for i in window.intervals)
    if all(i.kv_usage >= s.kv_usage_high and i.waiting >= s.waiting_high for i in window.intervals):
        lowest_kv = min(i.kv_usage for i in window.intervals)
        message = (
            f"KV cache >= {s.kv_usage_high:.0%} and >= {s.waiting_high:g} waiting per replica at every "
            f"scrape (lowest {lowest_kv:.0%} and {lowest:.3g})"
        )
        return Demand(DEMAND_KV, message)
    if lowest < s.waiting_min or window.preemption_rate >= STORM_PART_FLOOR * s.preemption_rate:
        return None
    queued = f"{lowest:.3g} or more waiting per replica at every scrape"
    if s.ttft_p99_slo_s is not None:
        p99 = window.ttft_p99_s
        if p99 is None or p99 <= s.ttft_p99_slo_s:
            return None
        return Demand(DEMAND_TTFT, f"{queued} and TTFT p99 {p99:.3g}s > SLO {s.ttft_p99_slo_s:g}s, {kv}")
    queue_time = window.queue_time_s
    if queue_time is None or queue_time <= s.queue_time_high_s:
        return None
    message = f"{queued} and mean queue time {queue_time:.3g}s > {s.queue_time_high_s:g}s (no TTFT SLO), {kv}"
    return Demand(DEMAND_QUEUE_TIME, message)


def is_demand(window: MetricWindow, s: RemediationSettings) -> bool:
    """Whether a demand rule fires on the window (:func:`demand_of`)."""
    return demand_of(window, s) is not None


def is_idle(window: MetricWindow, s: RemediationSettings) -> bool:
    """Over a full window: no preemption, no request waiting and KV usage below ``kvCacheUsageIdle``
    at every scrape."""
    return (
        window.full
        and window.num_preemptions == 0
        and window.waiting_max == 0
        and window.kv_usage_max < s.kv_usage_idle
    )


def is_quiet(window: MetricWindow) -> bool:
    """Over a full window: no request at all -- none running or waiting at any scrape, none got a first
    token, nothing preempted (what scale to zero waits for, ``spec.remediation.idleAfter``)."""
    return (
        window.full
        and window.num_preemptions == 0
        and window.waiting_max == 0
        and window.running == 0
        and window.num_first_tokens == 0
    )
