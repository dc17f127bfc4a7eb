"""The way requests reach a simulated engine (torch-free): when each is sent -- at its time, or once
one of a closed loop's clients is free -- and the server's turns on it before and after the engine
admits it (``simulate(handling=...)``, ``handling.HandlingTime``) -- and the server's turns on the
``/metrics`` scrapes, which come every so often whatever the requests do (``simulate(scrapes=...)``,
``handling.ScrapeTurns``)."""

from __future__ import annotations

import collections
import heapq
import math
import random
from collections.abc import Callable, Iterable, Sequence

from kvpilot.operator.plan.sim_result import SimulationError


class Ingest:
    """The way in: each arrival is sent (at its time, or once a client is free) and then handled by the
    server before it reaches the engine, which stamps its arrival there; once the engine admits it, the
    server takes another turn to start its response (``respond``). The server does one thing at a time,
    on the interpreter the engine's steps also run on, so a step that overlaps the server's turns ends
    that much later (``step_end``). ``handling``: one turn's time at a quantile drawn from ``rng``
    (None: no turns; a request reaches the engine when it is sent). ``scrapes``: (period in seconds,
    one render's time at a quantile): a scrape every period, each a turn of the server's like a
    request's, the first ``scrape_phase`` of a period after the first arrival (None: drawn from
    ``rng``); None: no scrape turns. ``scrape_times``: when the scrapes come instead (the arrivals'
    clock, ascending; a recording's own, for the requests of its trace), every period after the last.
    ``stamped``: the times are when each request reached the engine, its turn behind it (a trace's
    stamps), so the turn ends there instead of starting there (unless a client held the request back,
    which then sends it when free)."""

    def __init__(
        self,
        times: Sequence[float],
        max_in_flight: int | None,
        handling: Callable[[float], float] | None,
        rng: random.Random,
        scrapes: tuple[float, Callable[[float], float]] | None = None,
        scrape_phase: float | None = None,
        scrape_times: Sequence[float] = (),
        stamped: bool = False,
    ) -> None:
        self.times = times
        self.stamped = stamped
        # When each client can send again (max_in_flight of them; a min-heap): at once at first, then
        # a turnaround after its request finished.
        self.clients_free_at = [-math.inf] * max_in_flight if max_in_flight is not None else None
        self.handling = handling
        self.rng = rng
        self.next_index = 0  # the next arrival to send
        self.free_at = -math.inf  # when the server is done with what it has taken in
        self.handled: collections.deque[tuple[float, int]] = collections.deque()  # (stamp, index)
        self.scrape_period, self.render = scrapes if scrapes is not None else (math.inf, None)
        if scrapes is not None and not self.scrape_period > 0:
            raise SimulationError(f"the scrape period must be > 0, got {self.scrape_period!r}")
        self.next_scrape = math.inf  # when the next scrape comes (inf: none)
        # The scrapes still to come at their given times, the soonest last (popped from the end).
        self.scrapes_at = sorted(scrape_times, reverse=True) if scrapes is not None else []
        if scrapes is not None and self.scrapes_at:
            self.next_scrape = self.scrapes_at.pop()
        elif scrapes is not None:
            phase = rng.random() if scrape_phase is None else scrape_phase
            self.next_scrape = (times[0] if times else 0.0) + phase * self.scrape_period

    def _turn(self, draw: Callable[[float], float] | None, what: str) -> float:
        """One turn's seconds from ``draw`` at a quantile of this stream; ``what`` names it in the
        error for a negative one."""
        assert draw is not None
        seconds = draw(self.rng.random())
        if not seconds >= 0.0:
            raise SimulationError(f"{what} must be >= 0, got {seconds!r}")
        return seconds

    def _draw(self) -> float:
        return self._turn(self.handling, "a request's handling time")

    def _scrape(self) -> float:
        """Take the next scrape in: a turn after what the server is doing; returns its seconds."""
        seconds = self._turn(self.render, "a scrape's render time")
        self.free_at = max(self.free_at, self.next_scrape) + seconds
        self.next_scrape = self.scrapes_at.pop() if self.scrapes_at else self.next_scrape + self.scrape_period
        return seconds

    def _scrapes_until(self, t: float) -> None:
        """Take in every scrape that came by ``t``, in turn with the server's other work."""
        while self.next_scrape <= t:
            self._scrape()

    @property
    def pending(self) -> bool:
        return bool(self.handled) or self.next_index < len(self.times)

    def next_sent(self) -> float:
        """When the next arrival is sent: its time, or when a client is next free (never while every
        client has a request in the engine)."""
        if self.next_index >= len(self.times):
            return math.inf
        time = self.times[self.next_index]
        free = self.clients_free_at
        if free is None:
            return time
        return max(time, free[0]) if free else math.inf

    def take(self) -> float:
        """Send the next arrival and queue its handling; returns the handling's seconds."""
        sent = self.next_sent()
        held = sent > self.times[self.next_index]
        if self.clients_free_at is not None:
            heapq.heappop(self.clients_free_at)
        if self.stamped and not held:
            seconds = self._draw() if self.handling is not None else 0.0
            sent -= seconds  # the turn that ended at the stamp
            self._scrapes_until(sent)
        else:
            self._scrapes_until(sent)
            seconds = self._draw() if self.handling is not None else 0.0
        begin = max(sent, self.free_at)
        self.free_at = begin + seconds
        self.handled.append((self.free_at, self.next_index))
        self.next_index += 1
        return seconds

    def take_until(self, now: float) -> None:
        while self.next_sent() <= now:
            self.take()

    def first_stamp(self) -> float:
        """When the next request reaches the engine (sending the next arrival if none is handled)."""
        if not self.handled:
            self.take()
        return self.handled[0][0]

    def reached(self, now: float) -> Iterable[tuple[float, int]]:
        while self.handled and self.handled[0][0] <= now:
            yield self.handled.popleft()

    def respond(self, now: float) -> None:
        """The engine admitted a request at ``now``: the server starts its response, a turn of its own
        after what it is already doing."""
        self._scrapes_until(now)
        if self.handling is not None:
            self.free_at = max(self.free_at, now) + self._draw()

    def step_end(self, now: float, engine_s: float) -> float:
        """When a step that starts at ``now`` and needs ``engine_s`` of the interpreter ends: after the
        handling already under way, and after that of every arrival sent and every scrape come before
        it ends."""
        self._scrapes_until(now)
        end = now + engine_s + max(0.0, self.free_at - now)
        while True:
            sent = self.next_sent()
            if min(sent, self.next_scrape) >= end:
                return end
            end += self.take() if sent <= self.next_scrape else self._scrape()

    def finished(self, client_free_at: float) -> None:
        if self.clients_free_at is not None:
            heapq.heappush(self.clients_free_at, client_free_at)
