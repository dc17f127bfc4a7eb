"""The fidelity benchmark's traffic samples (``benchmarks/fidelity_traffic.py``): fresh samples of an
open-loop client's own process, and their p99s through the plan."""

from __future__ import annotations

import dataclasses
import math
import random
import statistics

import pytest

from benchmarks.fidelity_traffic import clients_arrivals, quantile_interval, rank_of, traffic_p99s
from kvpilot.operator.api.settings import resolve
from kvpilot.operator.plan.candidates import context_of
from kvpilot.operator.plan.recording import read_recording
from kvpilot.operator.plan.simulate import Arrival
from kvpilot.operator.plan.workload import workload_from_scrapes
from tests.operator.test_plan_cli import FIXTURE, isvc


@dataclasses.dataclass(frozen=True)
class _Load:  # the fields of plan_fidelity.Load that an open-loop sample reads
    rate: float
    prompt: tuple[int, int]
    output: tuple[int, int]
    shared_prefix: int = 0


def test_a_sample_is_poisson_at_the_rate_with_uniform_lengths_and_the_shared_prefix() -> None:
    load = _Load(rate=3.0, prompt=(100, 300), output=(8, 24), shared_prefix=150)
    arrivals = clients_arrivals(load, 10.0, 1010.0, random.Random(1))
    # 3,000 expected; Poisson's standard deviation is ~55.
    assert 2780 <= len(arrivals) <= 3220
    times = [a.time for a in arrivals]
    assert times == sorted(times) and 10.0 < times[0] and times[-1] <= 1010.0
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(1 / 3, rel=0.08)
    # Exponential gaps: their standard deviation equals their mean (a uniform or fixed gap's does not).
    assert statistics.stdev(gaps) == pytest.approx(statistics.mean(gaps), rel=0.1)
    assert {a.prompt_len for a in arrivals} <= set(range(100, 301))
    assert {a.output_len for a in arrivals} <= set(range(8, 25))
    assert min(a.prompt_len for a in arrivals) < 120 and max(a.prompt_len for a in arrivals) > 280
    assert all(a.prefix_group == 0 and a.prefix_len == min(150, a.prompt_len - 1) for a in arrivals)
    # A prompt shorter than the shared prefix shares all but its last token.
    short = clients_arrivals(_Load(2.0, (4, 8), (1, 2), shared_prefix=16), 0.0, 50.0, random.Random(2))
    assert short and all(a.prefix_len == a.prompt_len - 1 for a in short)
    plain = clients_arrivals(_Load(2.0, (4, 8), (1, 2)), 0.0, 50.0, random.Random(2))
    assert all(a.prefix_group is None and a.prefix_len == 0 for a in plain)
    assert clients_arrivals(load, 10.0, 1010.0, random.Random(1)) == arrivals
    with pytest.raises(ValueError, match="positive rate"):
        clients_arrivals(_Load(0.0, (1, 2), (1, 2)), 0.0, 1.0, random.Random(0))


def test_traffic_p99s_move_with_the_sample_not_between_calls() -> None:
    doc = isvc()
    workload = workload_from_scrapes(read_recording(FIXTURE, doc))
    step_time = workload.step_time()
    ctx = context_of(resolve(doc), workload)
    trace = tuple(Arrival(float(t), 64, 64) for t in range(0, 40, 2))
    traced = dataclasses.replace(workload, trace=trace)
    load = _Load(rate=4.0, prompt=(32, 256), output=(32, 256))
    loose = dataclasses.replace(ctx.current, max_num_seqs=64)
    tight = dataclasses.replace(ctx.current, max_num_seqs=2)
    p99s = traffic_p99s([loose, tight], ctx, traced, step_time, load, samples=4, seed=3)
    assert len(p99s) == 2 and all(len(row) == 4 for row in p99s)
    assert all(math.isfinite(x) and x > 0 for row in p99s for x in row)
    assert len(set(p99s[1])) > 1  # the samples differ, so do their p99s
    # Two sequences at a time queue the rest: every sample's p99 is above the loose setting's.
    assert all(t > lo for t, lo in zip(p99s[1], p99s[0], strict=True))
    assert traffic_p99s([loose, tight], ctx, traced, step_time, load, samples=4, seed=3) == p99s
    with pytest.raises(ValueError, match="trace"):
        traffic_p99s([loose], ctx, workload, step_time, load, samples=1)


def test_rank_of_counts_the_finite_values_below() -> None:
    assert rank_of(5.0, [1.0, 7.0, math.nan, 3.0, 5.0]) == (2, 4)
    assert rank_of(0.0, []) == (0, 0)


def test_the_p99_interval_holds_the_true_p99_about_as_often_as_it_says() -> None:
    """Samples of 1,100 draws of an exponential (mean 1; its p99 is ln 100): the 95 % interval of the
    sample's p99 holds the true one in 90-99 % of 400 samples, and the two ends bracket the sample's
    own p99 (the 11th largest of 1,100)."""
    rng, truth, held = random.Random(7), math.log(100.0), 0
    for _ in range(400):
        sample = [rng.expovariate(1.0) for _ in range(1100)]
        lo, hi = quantile_interval(sample, 0.99)
        ordered = sorted(sample)
        assert lo <= ordered[1088] <= hi and lo < hi
        held += lo <= truth <= hi
    assert 0.90 <= held / 400 <= 0.99
    assert all(math.isnan(x) for x in quantile_interval([], 0.99))
