"""One pod's scrapes over time, its preemption counter made monotonic across restarts, and the one
ingest that the remediation loop and ``kvpilot replay`` both feed it through.

Pure: no I/O and no clock. Counter resets: a restarted engine starts ``vllm:num_preemptions_total`` at
0 again. A reset is seen when the value goes down, or when the counter's ``_created`` timestamp changes
(which also catches a restart whose new count already passed the old one between two scrapes). The
increase across a reset is the new value (what the restarted process counted), as in Prometheus'
``increase()``.
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


class PodSeries:
    """The scrapes of one pod (one pod uid), oldest first, with a reset-proof preemption count.

    ``ingest`` takes one scrape's answer as it came (the loop and the replay feed it); ``add`` takes a
    complete scrape (``missing`` empty) in time order; ``fail`` records a scrape that failed (no answer,
    a bad status, an unparsable or partial body). Samples older than
    ``retention_s`` before the newest are dropped.
    """

    def __init__(self, name: str, retention_s: float = 3600.0) -> None:
        self.name = name
        self.retention_s = retention_s
        self._points: deque[Point] = deque()
        self.resets: deque[float] = deque()  # times at which a counter reset was seen
        self.last_error: str | None = None

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
        self._points.append(Point(scrape, total))
        self.last_error = None
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
        ``error`` of a failed scrape. A complete scrape joins the series; a failure, an unparsable body
        or a partial one (required metrics missing) is recorded with :meth:`fail`."""
        if error is not None:
            self.fail(error)
            return
        try:
            scrape = parse_scrape(metrics, time)
        except MetricsParseError as exc:
            self.fail(str(exc))
            return
        if scrape.missing:
            self.fail(f"partial scrape, lacks {', '.join(scrape.missing)}")
        else:
            self.add(scrape)
