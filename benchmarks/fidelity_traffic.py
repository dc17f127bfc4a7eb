"""How far a TTFT p99 moves with the sample of the traffic alone: the clients' own process through the
plan's simulator, sample after sample (torch-free; used by ``plan_fidelity.py --traffic-samples``).

An open-loop client of the fidelity benchmark sends Poisson arrivals at a fixed rate with lengths
uniform in fixed ranges. The engine's measured p99 is one sample of that process; the plan's
prediction, drawn from the recording, is another. Near a knee (a queue that forms only when a few
long requests overlap) the p99 of a couple of thousand requests is decided by a handful of such
overlaps, and moves a lot from one sample to the next whatever the model. This module draws
``samples`` fresh samples of the clients' process over the span the measured requests covered, runs
each through the simulator with the plan's own calibration and step-time model, and returns their
p99s: where the measured p99 falls among them says whether a miss is the model's or the sample's.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from collections.abc import Sequence
from typing import Any

from kvpilot.operator.plan.candidates import Candidate, evaluate
from kvpilot.operator.plan.simulate import Arrival


def clients_arrivals(load: Any, start: float, end: float, rng: random.Random) -> list[Arrival]:
    """One sample of an open-loop ``load`` (``rate``, ``prompt``, ``output``, ``shared_prefix``, as
    ``plan_fidelity.Load``) between ``start`` and ``end`` seconds: Poisson arrivals, uniform lengths,
    the first ``shared_prefix`` prompt tokens (at most all but one) shared by every request."""
    if not load.rate > 0:
        raise ValueError(f"an open-loop load needs a positive rate, got {load.rate!r}")
    arrivals = []
    t = start
    while True:
        t += rng.expovariate(load.rate)
        if t > end:
            return arrivals
        prompt = rng.randint(*load.prompt)
        shared = min(load.shared_prefix, prompt - 1)
        arrivals.append(
            Arrival(
                t,
                prompt,
                rng.randint(*load.output),
                prefix_group=0 if shared else None,
                prefix_len=shared,
            )
        )


def traffic_p99s(
    candidates: Sequence[Candidate],
    ctx: Any,
    workload: Any,
    step_time: Any,
    load: Any,
    samples: int,
    seed: int = 0,
) -> list[list[float]]:
    """Per candidate, the predicted TTFT p99 of ``samples`` samples of the clients' process over the
    span of ``workload``'s request trace (its first to its last arrival), each replayed as a trace
    through ``evaluate`` with ``ctx`` and ``step_time`` (NaN where a sample cannot be simulated).
    Sample ``k`` draws from its own stream (``seed``, ``k``), the same for every candidate."""
    if workload.trace is None or not workload.trace:
        raise ValueError("the clients' process is laid over a request trace's span: the workload has none")
    start, end = workload.trace[0].time, workload.trace[-1].time
    draws = [clients_arrivals(load, start, end, random.Random(f"traffic-{seed}-{k}")) for k in range(samples)]
    out = []
    for candidate in candidates:
        p99s = []
        for arrivals in draws:
            result = evaluate(
                candidate, ctx, dataclasses.replace(workload, trace=tuple(arrivals)), step_time
            ).result
            p99s.append(result.ttft(0.99) if result is not None else math.nan)
        out.append(p99s)
    return out


def rank_of(value: float, sample: Sequence[float]) -> tuple[int, int]:
    """How many of the finite values of ``sample`` lie below ``value``, and how many are finite."""
    finite = [x for x in sample if math.isfinite(x)]
    return sum(x < value for x in finite), len(finite)


def quantile_interval(values: list[float], q: float, level: float = 0.95) -> tuple[float, float]:
    """A distribution-free ``level`` interval for the ``q`` quantile of what ``values`` sample: the
    order statistics whose ranks bound the count of samples below that quantile, a binomial (n, q),
    at its two tails (normal approximation). With some 1,100 requests the p99 is the 11th slowest
    and its 95 % interval runs from about the 18th to the 5th slowest."""
    if not values:
        return math.nan, math.nan
    ordered, n = sorted(values), len(values)
    z = statistics.NormalDist().inv_cdf(0.5 + level / 2)
    half = z * math.sqrt(n * q * (1 - q))
    lo = min(n, max(1, math.floor(n * q - half)))
    hi = min(n, max(1, math.ceil(n * q + half)))
    return ordered[lo - 1], ordered[hi - 1]
