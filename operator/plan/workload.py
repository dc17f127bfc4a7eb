"""The workload a service has seen, from a recording: when requests came, how long they were, and
the KV pool they ran on (torch-free).

* **Arrivals.** Engines count requests when they finish (``vllm:request_success_total``, every
  finished reason), so the requests that arrived by a scrape are those finished since the first
  scrape plus those in flight (running + waiting + swapped) now, minus those in flight at the first
  one. Per pod interval that gives an arrival count (made monotone; fractions carried over), spread
  at seeded uniform random times within the interval. Pods add up: the arrivals are the service's.
* **Lengths.** ``vllm:request_prompt_tokens`` / ``vllm:request_generation_tokens`` are also observed
  at finish, so an interval's arrivals take the lengths of the requests that finish from it on: the
  histogram increases of that interval and the following ones of the same pod until they hold
  ``MIN_LENGTH_SAMPLES`` requests (earlier ones when the recording ends first). They are drawn as
  :mod:`~kvpilot.operator.plan.lengths` says, with the mean the recording shows, and within a bucket
  with the spread its scrape intervals show there (a benchmark's fixed lengths are drawn fixed, not
  spread over a bucket of 10-500 tokens, which would put long waits where there were none).
* **The KV pool.** ``vllm:cache_config_info``: ``num_gpu_blocks``, ``block_size``, the
  ``gpu_memory_utilization`` it was sized with, whether it was sized explicitly
  (``num_gpu_blocks_override``), ``enable_prefix_caching`` and ``num_cpu_blocks``.
* **Step windows** for ``step_time.fit_step_time``, and by interval (``step_intervals``) for the
  variation over time ``step_time.with_variation`` replays, or (``Workload.step_time(spread=True)``)
  the spread of single steps (``kvpilot_engine_step_time_ratio``) ``step_time.with_jitter`` draws
  from where the engine exports it (see there).

* **Client concurrency.** The most requests the pods held at once (``peak_in_flight``): clients
  that wait for answers never keep more in flight, whatever the engine does. The plan caps each
  replica's in-flight requests at its share of it (``simulate(max_in_flight=...)``), so that a
  simulation running a little slower than the real engine does not pile up requests the real
  clients would never have sent -- the difference between a storm and none near the threshold.
* **An engine that paced its clients** (``saturated``: a request waiting at nearly every scrape, or
  every pod holding nearly its peak number of requests). Then the arrivals the recording shows are what
  the engine let through, not what the clients asked for: closed-loop clients (or a backlog) send
  the next request as soon as one finishes. The plan then
  replays the requests closed-loop at the peak concurrency, each sent as soon as the cap allows, so
  that a faster candidate (a live relief lifted, a larger pool) is predicted under the load its
  clients would really make, not the load the slower settings in force admitted. Each replayed
  request is sent the clients' turnaround after the one it follows ends (``client_turnaround_s``:
  reading the answer, the round trip, the server's parsing), so that it lands inside the step then
  running and waits for it as a real client's does; Little's law gives it from the recording.

* **Prefix-cache hits.** ``vllm:prefix_cache_hits_total`` over ``vllm:prefix_cache_queries_total``
  (prompt tokens found over those looked up) where the pool caches prefixes (``prefix_hit_rate``).
  The plan gives every drawn prompt a prefix shared with the others, of the length that makes the
  settings in force hit as often in simulation as they did (``calibrate.calibrate_prefix``).

What it does not know: prompt contents (the hits are modelled as one prefix every prompt shares, so
a pool that holds more gains no hits in simulation), per-request pairing of prompt and output lengths
(drawn independently), and how clients react to latency beyond that cap (arrivals replay at the
recorded times).
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter
from collections.abc import Sequence

from kvpilot.engine import metrics_names as m
from kvpilot.operator.plan.aggregates import (
    client_turnaround,
    mean_of,
    peak_in_flight,
    prefix_hit_rate,
    saturated,
    summed,
)
from kvpilot.operator.plan.handling import (
    HandlingTime,
    ScrapeTurns,
    handling_time_of,
    intake_time_of,
    scrape_turns_of,
    without_turns,
)
from kvpilot.operator.plan.lengths import LengthDistribution, bucket_spreads
from kvpilot.operator.plan.pool import KVPool, pool_of
from kvpilot.operator.plan.recording import Interval, PlanScrape, RecordingError, intervals_of
from kvpilot.operator.plan.simulate import Arrival
from kvpilot.operator.plan.step_time import (
    MIN_JITTER_STEPS,
    LinearStepTime,
    StepWindow,
    fit_step_time,
    with_jitter,
    with_variation,
)
from kvpilot.operator.remediation.metrics import Histogram

MIN_LENGTH_SAMPLES = 8


@dataclasses.dataclass(frozen=True)
class ArrivalWindow:
    """One pod interval's arrivals: from ``start`` (seconds from the recording's start) for
    ``seconds``, ``num_arrivals`` of them, with the lengths of ``prompt`` / ``generation``."""

    start: float
    seconds: float
    num_arrivals: int
    prompt: LengthDistribution
    generation: LengthDistribution


@dataclasses.dataclass(frozen=True)
class Workload:
    """What a recording says about the traffic (service-wide) and one replica's KV pool."""

    windows: tuple[ArrivalWindow, ...]
    pool: KVPool
    duration_s: float
    num_pods: int
    num_preemptions: float = 0.0  # what the recorded pods counted, all together
    # The most requests the pods held at once (running + waiting + swapped), summed over the pods'
    # peaks: what the clients kept in flight at most (None without the gauges).
    peak_in_flight: int | None = None
    # A request waited, or the pods held nearly their peak, at nearly every scrape (at least
    # SATURATED_FRACTION of them): the recorded arrivals are what the engine admitted, not what the
    # clients would have sent.
    saturated: bool = False
    # The requests as a per-request trace recorded them (``kvpilot serve --request-trace``), used
    # instead of the histograms' distributions when given (``with_trace``).
    trace: tuple[Arrival, ...] | None = None
    # With the trace of a recording of one pod: its scrapes' times (seconds from the recording's
    # start, the trace's clock), when the simulation takes the server's turns on them, so the traced
    # requests meet the very scrapes they met (``with_trace``). Empty: the scrapes' phase is drawn.
    scrape_times: tuple[float, ...] = ()
    # The mean of the recorded vllm:time_to_first_token_seconds over the recording (None: not
    # exported, or no first token in it): what the engine measured from a request's arrival, which
    # includes time the simulated scheduler does not see (see calibrate.calibrate_ttft).
    ttft_mean_s: float | None = None
    # The engine steps by pod interval: (start, end) in seconds from the recording's start, and the
    # interval's step windows (``step_windows_of``).
    step_intervals: tuple[tuple[float, float, tuple[StepWindow, ...]], ...] = ()
    # Prompt tokens the prefix cache found over those looked up, over the recording (None: the pool
    # caches no prefixes, or the counters were not exported or saw no lookup).
    prefix_hit_rate: float | None = None
    # How long a closed-loop client takes between a request's end and its next request reaching the
    # engine (``aggregates.client_turnaround``); 0 where the recording cannot tell (not saturated:
    # the arrivals are the clients' own, and no request's end paces the next).
    client_turnaround_s: float = 0.0
    # kvpilot_engine_step_time_ratio over the recording (None: not exported): the spread of single
    # decode steps around their mean, which ``step_time(spread=True)`` draws from (with_jitter).
    step_time_ratio: Histogram | None = None
    # kvpilot_engine_arrival_gap_seconds over the recording (None: not exported): the short ones are
    # the server's time on each request of a burst (``handling_time``).
    arrival_gaps: Histogram | None = None
    # kvpilot_engine_metrics_render_seconds over the recording (None: not exported): the server's
    # turns on the /metrics scrapes (``scrape_turns``).
    metrics_renders: Histogram | None = None
    # kvpilot_engine_request_intake_seconds over the recording (None: not exported): the server's time
    # on each request it took in alone, which ``handling_time`` prefers to the short arrival gaps.
    request_intakes: Histogram | None = None

    @property
    def step_windows(self) -> tuple[StepWindow, ...]:
        """Every interval's step windows, in time order (what the step time is fitted on)."""
        return tuple(w for _, _, windows in self.step_intervals for w in windows)

    def step_time(self, spread: bool = False) -> LinearStepTime:
        """The step-time model fitted on the recorded steps, with their variation over time (``spread``:
        the recorded spread of single steps where there is enough of it; see ``step_time``), less the
        server's turns the simulation adds itself (``without_turns``). Raises StepTimeError (no step)."""
        model = fit_step_time(self.step_windows)
        ratios = self.step_time_ratio
        if spread and ratios is not None and ratios.count >= MIN_JITTER_STEPS:
            model = with_jitter(model, ratios, scale_s=self.decode_step_s)
        else:
            model = with_variation(model, self.step_intervals)
        return without_turns(
            model, self.handling_time, self.num_requests, self.step_windows, self.scrape_turns
        )

    @property
    def handling_time(self) -> HandlingTime | None:
        """The server's turn on a request: from the timed intakes where the recording has enough, else
        from the arrival gaps within a mean decode step."""
        timed = intake_time_of(self.request_intakes)
        return timed if timed is not None else handling_time_of(self.arrival_gaps, self.decode_step_s)

    @property
    def scrape_turns(self) -> ScrapeTurns | None:
        """The server's turns on the /metrics scrapes: the renders over the pods' recorded time."""
        return scrape_turns_of(
            self.metrics_renders, sum(end - begin for begin, end, _ in self.step_intervals)
        )

    @property
    def decode_step_s(self) -> float:
        """The recorded decode steps' mean wall time (the step counters' windows that fed one token per
        sequence); 0 without any."""
        decode = [
            w for w in self.step_windows if w.shape_known and w.num_batched_tokens == w.num_sampled_tokens
        ]
        steps = sum(w.num_steps for w in decode)
        return sum(w.seconds for w in decode) / steps if steps > 0 else 0.0

    @property
    def preemptions_per_s(self) -> float:
        """Recorded preemptions per second per pod (to set the predictions against)."""
        return self.num_preemptions / self.duration_s / self.num_pods if self.duration_s > 0 else 0.0

    @property
    def num_requests(self) -> int:
        if self.trace is not None:
            return len(self.trace)
        return sum(w.num_arrivals for w in self.windows)

    @property
    def arrival_rate(self) -> float:
        """Requests per second over the recording, service-wide."""
        return self.num_requests / self.duration_s if self.duration_s > 0 else 0.0

    def arrivals(self, seed: int = 0) -> list[Arrival]:
        """The arrivals (seconds from the recording's start), drawn with ``seed``, in time order; the
        trace's as recorded when there is one."""
        if self.trace is not None:
            return list(self.trace)
        rng = random.Random(seed)
        out = []
        for w in self.windows:
            if not w.num_arrivals:
                continue
            prompts = w.prompt.sample(rng, w.num_arrivals)
            outputs = w.generation.sample(rng, w.num_arrivals)
            times = sorted(w.start + rng.random() * w.seconds for _ in range(w.num_arrivals))
            out += [Arrival(t, p, o) for t, p, o in zip(times, prompts, outputs, strict=True)]
        return sorted(out, key=lambda a: a.time)


def _merged(intervals: Sequence[Interval], index: int, name: str) -> Histogram | None:
    """The histogram ``name`` over intervals ``index``, ``index + 1``, ... until it holds
    ``MIN_LENGTH_SAMPLES`` observations, then backwards from ``index - 1`` if it still does not."""
    total: Histogram | None = None
    order = list(range(index, len(intervals))) + list(range(index - 1, -1, -1))
    for i in order:
        h = intervals[i].histograms.get(name)
        if h is None or h.count <= 0:
            continue
        total = h if total is None else total + h
        if total.count >= MIN_LENGTH_SAMPLES:
            break
    return total


def step_windows_of(interval: Interval) -> list[StepWindow]:
    """The engine steps of an interval and the time they took (see ``step_time``): one window per
    (phase, batch class) from kvpilot's step counters when the interval has them, else one window from
    the counters every engine exports; none when the interval lacks the counts or their time."""
    classes = [
        StepWindow(steps, tokens, seqs, seconds, context, pairs, shape_known=True)
        for steps, seconds, tokens, seqs, context, pairs in interval.step_counters.values()
        if steps > 0 and seconds > 0
    ]
    if interval.step_counters:
        return classes  # exact where the engine counts its steps (none: an idle interval)
    iterations = interval.histograms.get(m.ITERATION_TOKENS_TOTAL)
    generated = interval.counters.get(m.GENERATION_TOKENS_TOTAL)
    if iterations is None or iterations.count <= 0 or generated is None:
        return []
    running_before = interval.before.gauges.get(m.NUM_REQUESTS_RUNNING, 0.0)
    running_after = interval.after.gauges.get(m.NUM_REQUESTS_RUNNING, 0.0)
    if running_before > 0 and running_after > 0:
        seconds = interval.seconds  # busy throughout: the steps filled the interval
    else:
        itl = interval.histograms.get(m.INTER_TOKEN_LATENCY_SECONDS)
        if itl is None or itl.count <= 0:
            return []
        seconds = itl.sum / itl.count * iterations.count
    return [StepWindow(iterations.count, iterations.sum, generated, seconds)]


def workload_from_scrapes(scrapes: Sequence[PlanScrape]) -> Workload:
    """The :class:`Workload` of a recording's scrapes. Raises RecordingError (one line) when they
    cannot give one: fewer than two scrapes of a pod, no request finished, no length histograms."""
    intervals = intervals_of(scrapes)
    if not intervals:
        raise RecordingError("the recording needs at least two scrapes of one pod (no interval to measure)")
    pool = pool_of(scrapes)
    start = min(s.time for s in scrapes)
    end = max(s.time for s in scrapes)
    by_pod: dict[tuple[int, str], list[Interval]] = {}
    for interval in intervals:
        by_pod.setdefault(interval.key, []).append(interval)
    windows: list[ArrivalWindow] = []
    lacking = []
    spreads = {
        name: bucket_spreads(h for i in intervals if (h := i.histograms.get(name)) is not None)
        for name in (m.REQUEST_PROMPT_TOKENS, m.REQUEST_GENERATION_TOKENS)
    }

    wholes = {name: summed(intervals, name) for name in spreads}

    def lengths(histogram: Histogram, name: str) -> LengthDistribution:
        return LengthDistribution(histogram, spreads[name], wholes[name])

    for (_, pod), series in sorted(by_pod.items()):
        if not any(m.REQUEST_SUCCESS_TOTAL in i.counters for i in series):
            lacking.append(f"{pod}: {m.REQUEST_SUCCESS_TOTAL}")
            continue
        if not any(i.histograms.get(m.REQUEST_PROMPT_TOKENS) for i in series) or not any(
            i.histograms.get(m.REQUEST_GENERATION_TOKENS) for i in series
        ):
            lacking.append(f"{pod}: {m.REQUEST_PROMPT_TOKENS} / {m.REQUEST_GENERATION_TOKENS}")
            continue
        first_in_flight = series[0].before.in_flight or 0.0
        finished = 0.0
        arrived = first_in_flight  # in flight at the first scrape: queued at the start
        counted = 0
        for index, interval in enumerate(series):
            finished += interval.counters.get(m.REQUEST_SUCCESS_TOTAL, 0.0)
            in_flight = interval.after.in_flight
            if in_flight is not None:
                arrived = max(arrived, finished + in_flight)
            else:
                arrived = max(arrived, finished + first_in_flight)
            num = math.floor(arrived + 1e-9) - counted
            prompt = _merged(series, index, m.REQUEST_PROMPT_TOKENS)
            generation = _merged(series, index, m.REQUEST_GENERATION_TOKENS)
            if num > 0 and prompt is not None and generation is not None:
                # Those in flight at the first scrape arrive at its time; the rest within the interval.
                head = math.floor(first_in_flight) if index == 0 else 0
                if head:
                    windows.append(
                        ArrivalWindow(
                            interval.start - start,
                            0.0,
                            head,
                            lengths(prompt, m.REQUEST_PROMPT_TOKENS),
                            lengths(generation, m.REQUEST_GENERATION_TOKENS),
                        )
                    )
                windows.append(
                    ArrivalWindow(
                        interval.start - start,
                        interval.seconds,
                        num - head,
                        lengths(prompt, m.REQUEST_PROMPT_TOKENS),
                        lengths(generation, m.REQUEST_GENERATION_TOKENS),
                    )
                )
                counted += num
    if not windows:
        detail = f" (missing: {'; '.join(lacking)})" if lacking else ""
        raise RecordingError(f"no request finished in the recording: nothing to plan for{detail}")
    step_intervals = tuple((i.start - start, i.end - start, tuple(step_windows_of(i))) for i in intervals)
    paced = saturated(scrapes)
    return Workload(
        windows=tuple(windows),
        pool=pool,
        duration_s=end - start,
        # The most pods of one recording: recordings laid end to end follow one another.
        num_pods=max(Counter(segment for segment, _ in by_pod).values()),
        num_preemptions=sum(i.counters.get(m.NUM_PREEMPTIONS_TOTAL, 0.0) for i in intervals),
        peak_in_flight=peak_in_flight(scrapes),
        saturated=paced,
        ttft_mean_s=mean_of(intervals, m.TIME_TO_FIRST_TOKEN_SECONDS),
        step_intervals=step_intervals,
        prefix_hit_rate=prefix_hit_rate(intervals) if pool.enable_prefix_caching else None,
        client_turnaround_s=client_turnaround(intervals) if paced else 0.0,
        step_time_ratio=summed(intervals, m.ENGINE_STEP_TIME_RATIO),
        arrival_gaps=summed(intervals, m.ENGINE_ARRIVAL_GAP_SECONDS),
        metrics_renders=summed(intervals, m.ENGINE_METRICS_RENDER_SECONDS),
        request_intakes=summed(intervals, m.ENGINE_REQUEST_INTAKE_SECONDS),
    )
