"""One pod's scrapes over time, its preemption counter made monotonic across restarts, and the one
ingest that the remediation loop and ``kvpilot replay`` both feed it through.

Pure: no I/O and no clock. Counter resets: a restarted engine starts ``vllm:num_preemptions_total`` at
0 again. A fall of the counter is not taken at its word (a buggy exporter, a proxy or a half-written
scrape can make one): it is a reset only when the process that counted evidently changed (its
``process_start_time_seconds`` or the counter's ``_created`` moved, which also catches a restart whose
new count already passed the old one between two scrapes), or when the next scrape keeps rising from
the new base. A dip that the next scrape undoes is dropped. Until the next scrape settles it, the pod's
data is bad (``PodSeries.problem``) and the policy does not act. The increase across a reset is the new
value (what the restarted process counted), as in Prometheus' ``increase()``. Each point says
whether it begins a new process (``Point.restarted``), so that the window reads the other counters a
restarted engine starts afresh (its latency histograms) the same way.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from kvpilot.operator.remediation.metrics import MetricsParseError, Scrape, parse_scrape


@dataclasses.dataclass(frozen=True)
class Point:
    """One complete scrape in a series, with the preemptions counted since the series began."""

    scrape: Scrape
    preemptions: float  # cumulative since the series began, resets folded in
    restarted: bool = False  # a counter reset lies between the point before and this one


def _restarted(before: Scrape, after: Scrape) -> bool:
    """Whether the process that counted changed between two scrapes (start time or counter creation)."""
    return any(
        a is not None and b is not None and a != b for a, b in zip(before.started, after.started, strict=True)
    )


class PodSeries:
    """The scrapes of one pod (one pod uid), oldest first, with a reset-proof preemption count.

    ``ingest`` takes one scrape's answer as it came (the loop and the replay feed it); ``add`` takes a
    complete, valid scrape (``missing`` and ``invalid`` empty); scrapes not newer than the newest seen
    are ignored (duplicates, out of order). ``fail`` records a scrape that got no usable answer (no
    answer, a bad status). ``problem`` says why the newest answer cannot be used (unparsable, partial,
    invalid samples, a counter fall not yet explained); it clears with the next usable scrape. Samples
    older than ``retention_s`` before the newest are dropped.
    """

    def __init__(self, name: str, retention_s: float = 3600.0) -> None:
        self.name = name
        self.retention_s = retention_s
        self._points: deque[Point] = deque()
        self.resets: deque[float] = deque()  # times at which a counter reset was seen
        self.last_error: str | None = None
        self.problem: str | None = None
        self._pending: Scrape | None = None  # a counter fall awaiting the next scrape's verdict
        self._newest = float("-inf")

    def add(self, scrape: Scrape) -> None:
        """Append a complete, valid scrape; one not newer than the newest seen is ignored."""
        if scrape.missing or scrape.invalid:
            what = scrape.missing or scrape.invalid
            raise ValueError(f"{self.name}: a partial or invalid scrape cannot join a series ({what})")
        if scrape.time <= self._newest:
            return
        self._newest = scrape.time
        self.last_error = None
        if not self._points:
            self._append(scrape, 0.0)
            return
        prev = self._points[-1]
        value, before = scrape.preemptions or 0.0, prev.scrape.preemptions or 0.0
        pending, self._pending = self._pending, None
        if _restarted(prev.scrape, scrape):
            self._reset(prev, scrape)
        elif value >= before:
            self._append(scrape, prev.preemptions + (value - before))  # a dip in between was a glitch
        elif pending is not None and value >= (pending.preemptions or 0.0):
            self._reset(prev, pending)  # it kept rising from the new base: a restart after all
            self._append(scrape, self._points[-1].preemptions + value - (pending.preemptions or 0.0))
        else:
            self._pending = scrape
            self.problem = (
                f"the preemption counter fell from {before:g} to {value:g} without a restart "
                "(the next scrape decides whether it was one)"
            )

    def _reset(self, prev: Point, scrape: Scrape) -> None:
        self.resets.append(scrape.time)
        self._append(scrape, prev.preemptions + (scrape.preemptions or 0.0), restarted=True)

    def _append(self, scrape: Scrape, total: float, restarted: bool = False) -> None:
        self._points.append(Point(scrape, total, restarted))
        self.problem = None
        horizon = scrape.time - self.retention_s
        while len(self._points) > 2 and self._points[1].scrape.time <= horizon:
            self._points.popleft()
        while self.resets and self.resets[0] <= horizon:
            self.resets.popleft()

    def fail(self, error: str) -> None:
        """Record a failed scrape; the series keeps its samples (they go stale on their own)."""
        self.last_error = error

    @property
    def last(self) -> Scrape | None:
        """The newest complete scrape, or None."""
        return self._points[-1].scrape if self._points else None

    def points(self) -> list[Point]:
        """The complete scrapes kept, oldest first, each with its cumulative preemption count."""
        return list(self._points)

    def ingest(self, time: float, metrics: str | list | dict | None, error: str | None = None) -> None:
        """Take one scrape's answer at ``time``: ``metrics`` (Prometheus text or parsed samples) or the
        ``error`` of a failed scrape. A complete, valid scrape joins the series; a failure is recorded
        with :meth:`fail`; an unparsable, partial or invalid body also sets :attr:`problem`."""
        if error is not None:
            self.fail(error)
            return
        try:
            scrape = parse_scrape(metrics, time)
        except MetricsParseError as exc:
            self._unusable(time, str(exc))
            return
        if scrape.invalid:
            self._unusable(time, f"invalid samples: {', '.join(scrape.invalid)}")
        elif scrape.missing:
            self._unusable(time, f"partial scrape, lacks {', '.join(scrape.missing)}")
        else:
            self.add(scrape)

    def _unusable(self, time: float, why: str) -> None:
        if time <= self._newest:
            return  # an old answer arriving late says nothing about now
        self._newest = time
        self.fail(why)
        self.problem = why
