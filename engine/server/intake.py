"""The server's time on taking in one generation request (``kvpilot_engine_request_intake_seconds``).

The server parses, validates and tokenizes requests on the interpreter its engine's steps also run on,
so a burst reaches the engine spread out, one such turn apart, and the step running meanwhile ends
later. The plan's simulation draws those turns (``operator/plan/handling.py``). An intake is timed from
the request reaching the application to its hand-off to the engine, and counted only when the server
had it to itself: another request's intake or a ``/metrics`` scrape meanwhile shares the interpreter,
and the wall time would hold their work too. The event loop runs every intake, so no lock is needed.
"""

from __future__ import annotations

import time

# The generation endpoints whose requests are timed.
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


class Intake:
    """One request being taken in: when it reached the application, and whether anything else shared
    the server with it since."""

    __slots__ = ("shared", "start")

    def __init__(self, start: float, shared: bool) -> None:
        self.start = start
        self.shared = shared


class Intakes:
    """The generation requests the server is taking in."""

    def __init__(self) -> None:
        self._open: set[Intake] = set()

    def begin(self) -> Intake:
        """A request reached the application; every intake open shares the server with it."""
        intake = Intake(time.perf_counter(), shared=bool(self._open))
        self.interrupt()
        self._open.add(intake)
        return intake

    def interrupt(self) -> None:
        """Other work (a scrape) took the server: no intake open now had it to itself."""
        for other in self._open:
            other.shared = True

    def end(self, intake: Intake) -> float | None:
        """The request was handed to the engine, or failed before: its seconds when it had the server
        to itself, else None. Ending an intake again gives None."""
        if intake not in self._open:
            return None
        self._open.discard(intake)
        return None if intake.shared else time.perf_counter() - intake.start
