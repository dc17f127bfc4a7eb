"""The server's turns: on a request, from its timed intakes or the arrival gaps, and on a scrape; torch-free.

kvpilot's server parses and tokenizes requests one at a time, on the interpreter its engine's steps
also run on, and once the engine has admitted a request it starts that request's response there too.
A burst -- the clients of a lockstep batch all answered by one step, sending again at once -- so
reaches the engine spread out, one turn apart; the step then running waits for the server to take the
burst in, and the step that admits it waits for the burst's responses to start. Measured over 159
lockstep bursts of seven in the fidelity benchmark's storm (2-core box, medians): arrivals 0.19 ms
apart (0.16-0.34 ms, 10th-90th percentile); the step running meanwhile 3.7 ms against 1.2 ms for the
one before it; the step that admitted the burst 3.2 ms against 1.3 ms for the next one of the same
eight sequences, about 0.26 ms more a request. The simulation models both turns
(``simulate(handling=...)``), drawing each from :class:`HandlingTime`.

kvpilot's server times each request it takes in alone, from reaching the application to its hand-off
to the engine (``kvpilot_engine_request_intake_seconds``): every request that meets no other is a
sample, however the clients send, and :func:`intake_time_of` draws the turns from those. A recording
without them (a runtime or release that does not export them) falls back to the arrival gaps
(``kvpilot_engine_arrival_gap_seconds``): the gaps shorter than the recording's mean decode step are
requests that came while the server was taking in the one before -- the engine would have run them in
the same step had they come together -- so those gaps are the server's turns; longer ones are the
clients' own spacing, which the arrivals already hold. Only a burst gives such a gap, and a storm that
preempts seldom sends one (six in one 25-second run of the fidelity benchmark's, whose 519 requests
were all timed intakes); the gaps also stop at the decode step, so the turns' tail is lost. Without either
there are no turns and a burst reaches the engine at once. The response's turn has no metric of its
own: it is drawn from the same distribution.

The server takes one more kind of turn: a ``/metrics`` scrape. Rendering some 500 samples in
prometheus_client takes about 4.5 ms of the interpreter on the 2-core box, and the server's whole
answer 7.3-7.7 ms on average in the fidelity benchmark's runs (``/health``: 0.5 ms); a step that
overlaps it ends that much later. At light load,
where a first token takes 5-30 ms, the requests that meet a scrape make up much of the slowest 2 %
(22-29 % of them in the fidelity benchmark, which scrapes every second, against about 2 % of the rest).
kvpilot's server times each scrape's answer, rendering and sending included
(``kvpilot_engine_metrics_render_seconds``); its count over the recording's pod-seconds is how often
the pod was scraped, by every scraper together, and
:class:`ScrapeTurns` has the simulation take one such turn every period. A runtime that renders its
metrics elsewhere than on its engine's interpreter (vLLM: the API server process) exports no such
histogram, and no scrape turn is modelled.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Sequence

from kvpilot.operator.plan.step_time import LinearStepTime, StepWindow
from kvpilot.operator.remediation.metrics import Histogram

# The most of the recorded steps' time the server's turns are taken to have held.
MAX_TURN_SHARE = 0.5
# Fewer short gaps than this say too little about the server's turn to draw from.
MIN_HANDLING_SAMPLES = 3
# Fewer renders than this say too little about a scrape's cost.
MIN_SCRAPE_SAMPLES = 3


@dataclasses.dataclass(frozen=True)
class HandlingTime:
    """The server's time on one request, drawn from ``pieces``: (cumulative probability, low, high)
    per gap bucket, uniform within its bounds."""

    pieces: tuple[tuple[float, float, float], ...]
    samples: float  # the recorded times the pieces were built from
    source: str = "short arrival gaps"  # what those times were

    @property
    def mean_s(self) -> float:
        below, total = 0.0, 0.0
        for cumulative, low, high in self.pieces:
            total += (cumulative - below) * (low + high) / 2
            below = cumulative
        return total

    def draw(self, u: float) -> float:
        """The handling time at quantile ``u`` in [0, 1)."""
        cumulatives = [c for c, _, _ in self.pieces]
        i = min(bisect.bisect_right(cumulatives, u), len(self.pieces) - 1)
        below = cumulatives[i - 1] if i > 0 else 0.0
        cumulative, low, high = self.pieces[i]
        within = (u - below) / (cumulative - below) if cumulative > below else 0.0
        return low + min(1.0, max(0.0, within)) * (high - low)

    def describe(self) -> str:
        return (
            f"a turn of {self.mean_s * 1e3:.2f} ms on average before a request reaches the engine and "
            f"another once it is admitted ({self.samples:.0f} {self.source})"
        )


def handling_time_of(
    gaps: Histogram | None, within_s: float, min_samples: float = MIN_HANDLING_SAMPLES
) -> HandlingTime | None:
    """The handling time the arrival gaps ``gaps`` show: those in buckets whose upper bound is at most
    ``within_s`` (the recording's mean decode step), each bucket uniform from the bound below it (the
    first from 0). None without a histogram, with ``within_s`` not positive, or with fewer than
    ``min_samples`` such gaps."""
    if gaps is None or not within_s > 0:
        return None
    pieces, below_le, below_count = [], 0.0, 0.0
    for le, cumulative in gaps.buckets:
        if math.isinf(le) or le > within_s:
            break
        if cumulative > below_count:
            pieces.append((cumulative - below_count, below_le, le))
        below_le, below_count = le, cumulative
    total = sum(count for count, _, _ in pieces)
    if total < min_samples or total <= 0:
        return None
    out, running = [], 0.0
    for count, low, high in pieces:
        running += count
        out.append((min(1.0, running / total), low, high))
    return HandlingTime(tuple(out), total)


def intake_time_of(
    intakes: Histogram | None, min_samples: float = MIN_HANDLING_SAMPLES
) -> HandlingTime | None:
    """The handling time the timed intakes ``intakes`` show, each bucket uniform from the bound below
    it, all of them (an intake is the server's own time, however long). None without a histogram or
    with fewer than ``min_samples`` intakes."""
    timed = handling_time_of(intakes, math.inf, min_samples)
    return dataclasses.replace(timed, source="timed intakes") if timed is not None else None


@dataclasses.dataclass(frozen=True)
class ScrapeTurns:
    """The server's turns on the ``/metrics`` scrapes: one every ``period_s``, each taking a render time
    drawn from ``render``."""

    period_s: float
    render: HandlingTime

    @property
    def share(self) -> float:
        """The share of the pod's time the scrapes hold the interpreter."""
        return self.render.mean_s / self.period_s

    def describe(self) -> str:
        return (
            f"a /metrics scrape every {self.period_s:.2f} s, {self.render.mean_s * 1e3:.2f} ms to answer "
            f"on average ({self.render.samples:.0f} scrapes)"
        )


def scrape_turns_of(
    renders: Histogram | None, pod_seconds: float, min_samples: float = MIN_SCRAPE_SAMPLES
) -> ScrapeTurns | None:
    """The scrape turns the render times ``renders`` show over ``pod_seconds`` (the recording's intervals
    summed over its pods): a period of ``pod_seconds`` over the renders, each render uniform within its
    bucket. None without a histogram, with ``pod_seconds`` not positive, or with fewer than
    ``min_samples`` renders."""
    if renders is None or not pod_seconds > 0:
        return None
    render = handling_time_of(renders, math.inf, min_samples)
    if render is None:
        return None
    return ScrapeTurns(pod_seconds / render.samples, render)


def without_turns(
    model: LinearStepTime,
    turn: HandlingTime | None,
    num_requests: int,
    windows: Sequence[StepWindow],
    scrapes: ScrapeTurns | None = None,
) -> LinearStepTime:
    """``model`` less the server's turns: the recorded steps' wall time holds the turns that fell within
    them, and the simulation adds each turn where it falls, so the coefficients are scaled by one less
    the share of the steps' time that two turns a recorded request make up, and the scrapes' share of
    the pod's time (a scrape falls within a step as often as the pod is busy; at most
    ``MAX_TURN_SHARE`` in all). ``model`` itself without a turn or without step time."""
    seconds = sum(w.seconds for w in windows)
    if (turn is None and scrapes is None) or not seconds > 0:
        return model
    share = 2 * turn.mean_s * num_requests / seconds if turn is not None else 0.0
    share += scrapes.share if scrapes is not None else 0.0
    keep = 1.0 - min(MAX_TURN_SHARE, share)
    return dataclasses.replace(
        model, a=model.a * keep, b=model.b * keep, c=model.c * keep, d=model.d * keep, e=model.e * keep
    )
