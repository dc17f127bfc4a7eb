"""Lengths drawn from a recording's histograms (``plan.lengths``): uniform within a bucket unless the
recording's scrape intervals show how its lengths spread there, as they do for a benchmark's fixed
lengths (the recorded vLLM storm: every long request 96 prompt tokens and 224 generated)."""

from __future__ import annotations

import math
import random
import statistics
from pathlib import Path

import pytest

from kvpilot.engine import metrics_names as m
from kvpilot.operator.plan.lengths import BucketSpread, LengthDistribution, bucket_spreads
from kvpilot.operator.plan.recording import intervals_of, read_recording
from kvpilot.operator.plan.workload import workload_from_scrapes
from kvpilot.operator.remediation.metrics import Histogram

BOUNDS = (10.0, 500.0, math.inf)
FIXTURE = Path(__file__).parent / "fixtures" / "vllm-0.32-cpu-storm.jsonl.gz"


def interval(counts: tuple[float, float, float], total: float) -> Histogram:
    """An interval's histogram: ``counts`` per bucket of BOUNDS (not cumulative), ``total`` their sum."""
    cumulative, buckets = 0.0, []
    for le, count in zip(BOUNDS, counts, strict=True):
        cumulative += count
        buckets.append((le, cumulative))
    return Histogram(tuple(buckets), total, cumulative)


def test_the_spread_in_a_bucket_comes_from_how_its_interval_means_differ():
    # Interval means 200, 240, 220, 180 of 4 lengths each: mean 210; the means vary by sigma^2 / 4,
    # so sigma^2 = 4 * (100 + 900 + 100 + 900) / (4 - 1).
    means = (200, 240, 220, 180)
    spreads = bucket_spreads([interval((0, 4, 0), 4 * x) for x in means])
    assert set(spreads) == {500.0}
    assert spreads[500.0].mean == pytest.approx(210)
    assert spreads[500.0].std == pytest.approx(math.sqrt(8000 / 3))
    # Fixed lengths: every interval's mean the same, no spread at all.
    fixed = bucket_spreads([interval((0, n, 0), 224 * n) for n in (6, 5, 7)])
    assert fixed == {500.0: BucketSpread(224.0, 0.0)}
    # Intervals with requests in two buckets, empty ones, and a bucket with fewer than three pure
    # intervals tell nothing.
    mixed = [interval((3, 3, 0), 3 * 8 + 3 * 224)] * 5 + [interval((0, 0, 0), 0.0)]
    assert bucket_spreads(mixed + [interval((2, 0, 0), 16)] * 2) == {}


def test_draws_keep_to_the_spread_the_recording_shows_and_to_the_mean():
    histogram = interval((0, 600, 0), 600 * 224)  # a window: 600 requests of mean 224, in (10, 500]
    rng = random.Random(0)
    uniform = LengthDistribution(histogram).sample(rng, 2000)
    assert min(uniform) < 60 and max(uniform) > 380  # the whole bucket, scaled to the mean
    fixed = LengthDistribution(histogram, {500.0: BucketSpread(224.0, 0.0)}).sample(rng, 2000)
    assert set(fixed) == {224}
    spread = LengthDistribution(histogram, {500.0: BucketSpread(224.0, 20.0)}).sample(rng, 2000)
    half = math.sqrt(3) * 20
    assert 224 - half - 1 <= min(spread) and max(spread) <= 224 + half + 1
    assert statistics.mean(spread) == pytest.approx(224, rel=0.01)
    assert statistics.pstdev(spread) == pytest.approx(20, rel=0.1)
    # A spread wider than the bucket is cut to it; the draws' mean is still the histogram's.
    wide = LengthDistribution(histogram, {500.0: BucketSpread(224.0, 1000.0)}).sample(rng, 4000)
    assert statistics.mean(wide) == pytest.approx(224, rel=0.03)


def test_a_stretchs_draws_keep_the_whole_recordings_mean_not_stretched_to_their_own():
    # The recording: lengths 200-240 in (10, 500] (mean 220, spread 20). One stretch of it holds four
    # requests that happened to average 240, and 4 short ones of 8 tokens.
    spreads = {500.0: BucketSpread(220.0, 20.0), 10.0: BucketSpread(8.0, 0.0)}
    whole = interval((400, 400, 0), 400 * 8 + 400 * 220)
    stretch = interval((4, 4, 0), 4 * 8 + 4 * 240)
    rng = random.Random(0)
    own = LengthDistribution(stretch, spreads).sample(rng, 4000)
    kept = LengthDistribution(stretch, spreads, whole).sample(rng, 4000)
    top = 220 + math.sqrt(3) * 20
    # Scaled to the stretch's own mean, every length grows by 124/114: short ones past 8 and long ones
    # past any the recording shows.
    assert min(own) == 9 and max(own) > top + 10
    # Scaled to the whole recording's, they stay where the recording shows them, with its mean.
    assert min(kept) == 8 and max(kept) <= top + 1
    assert statistics.mean(kept) == pytest.approx((8 + 220) / 2, rel=0.01)


def test_the_recorded_storm_draws_its_benchmark_lengths_fixed():
    scrapes = read_recording(FIXTURE, {"metadata": {"name": "llm", "namespace": "llm"}})
    # What the recording itself says, interval by interval: long requests of 96 prompt tokens and 224
    # generated, short ones of 16 and 8.
    long_means = {
        round(h.sum / h.count, 6)
        for i in intervals_of(scrapes)
        if (h := i.histograms.get(m.REQUEST_GENERATION_TOKENS)) is not None
        and h.count > 0
        and dict(h.buckets)[10.0] == 0  # none of at most 10 tokens
    }
    assert long_means == {224.0}
    workload = workload_from_scrapes(scrapes)
    arrivals = workload.arrivals(seed=3)
    assert {(a.prompt_len, a.output_len) for a in arrivals} <= {(16, 8), (96, 224), (16, 224), (96, 8)}
    assert sum(1 for a in arrivals if a.output_len == 224) >= 150
