"""Token lengths drawn from a recording's length histograms (``vllm:request_prompt_tokens``,
``vllm:request_generation_tokens``), torch-free.

A length is drawn as a bucket by its count, then within the bucket, and every draw is scaled by the
ratio of the histogram's true mean (sum / count) to the mean of the distribution drawn from, so the
mean length -- what the KV pool holds -- is the recorded one (the whole recording's, for the draws of
one stretch of it: ``LengthDistribution.whole``). Within a bucket the draw is uniform over
it, unless the recording shows how lengths spread there (:func:`bucket_spreads`); then it is uniform
over the lengths' mean +- sqrt(3) standard deviations, within the bucket.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
from collections.abc import Iterable, Mapping

from kvpilot.operator.remediation.metrics import Histogram

# Scrape intervals all of whose requests fell in one bucket, needed to estimate the lengths' spread there.
MIN_SPREAD_INTERVALS = 3


@dataclasses.dataclass(frozen=True)
class BucketSpread:
    """How the lengths in one histogram bucket spread, as the recording shows it: their mean and
    standard deviation (:func:`bucket_spreads`)."""

    mean: float
    std: float


def _bucket_counts(histogram: Histogram) -> list[tuple[float, float]]:
    """(upper bound, observations) of each bucket of a cumulative histogram."""
    counts, previous = [], 0.0
    for le, cumulative in histogram.buckets:
        counts.append((le, cumulative - previous))
        previous = cumulative
    return counts


def bucket_spreads(histograms: Iterable[Histogram]) -> dict[float, BucketSpread]:
    """Per bucket (by its upper bound), the lengths' mean and standard deviation, from the intervals'
    histograms whose observations all fell in that one finite bucket: the mean of their means
    weighted by their counts, and the deviation from n_i (m_i - M)^2 summed over K intervals / (K - 1),
    since an interval mean m_i of n_i lengths varies by sigma^2 / n_i. Buckets with fewer than
    ``MIN_SPREAD_INTERVALS`` such intervals are left out (drawn uniform)."""
    pure: dict[float, list[tuple[float, float]]] = {}  # le -> [(count, mean)]
    for h in histograms:
        if h.count <= 0:
            continue
        holding = [le for le, count in _bucket_counts(h) if count > 0]
        if len(holding) == 1 and math.isfinite(holding[0]) and math.isfinite(h.sum):
            pure.setdefault(holding[0], []).append((h.count, h.sum / h.count))
    out = {}
    for le, samples in pure.items():
        if len(samples) < MIN_SPREAD_INTERVALS:
            continue
        total = sum(n for n, _ in samples)
        mean = sum(n * x for n, x in samples) / total
        variance = sum(n * (x - mean) ** 2 for n, x in samples) / (len(samples) - 1)
        out[le] = BucketSpread(mean, math.sqrt(variance))
    return out


@dataclasses.dataclass(frozen=True)
class LengthDistribution:
    """Token lengths drawn from a cumulative histogram (see the module doc); ``spreads``: the
    recording's spread in some of its buckets (the others are drawn uniform)."""

    histogram: Histogram
    spreads: Mapping[float, BucketSpread] = dataclasses.field(default_factory=dict)
    # The histogram whose mean the draws keep (None: ``histogram``'s own). A recording's stretch holds
    # a few requests, and their mean within a bucket is chance; scaling a stretch's draws to it would
    # stretch the lengths past those the recording shows (a 10 % scale puts 800-token prompts at 880),
    # where scaling to the whole recording's mean keeps what the KV pool holds on average.
    whole: Histogram | None = None

    @property
    def mean(self) -> float:
        return self.histogram.sum / self.histogram.count

    @functools.cached_property
    def _scale(self) -> float:
        """What every draw is multiplied by: the mean of ``whole`` (or ``histogram``) over the mean of
        the distribution drawn from for it (once per distribution: every draw of the plan uses it)."""
        target = self if self.whole is None else LengthDistribution(self.whole, self.spreads)
        ranges = target._bucket_ranges()
        weights = sum(c for _, _, c in ranges)
        drawn_mean = sum((lo + hi) / 2 * c for lo, hi, c in ranges) / weights if weights > 0 else 0.0
        return target.mean / drawn_mean if drawn_mean > 0 else 1.0

    def _bucket_ranges(self) -> list[tuple[float, float, float]]:
        """(low, high, count) of what each bucket that holds observations is drawn from: the bucket,
        or where the recording shows its lengths spread, the mean +- sqrt(3) std within it. The
        ``+Inf`` bucket is the point at the highest finite bound."""
        out = []
        low = 0.0
        for le, count in _bucket_counts(self.histogram):
            high = low if math.isinf(le) else le
            if count > 0:
                spread = self.spreads.get(le)
                if spread is None or math.isinf(le):
                    out.append((low, high, count))
                else:
                    half = math.sqrt(3.0) * spread.std
                    out.append((max(low, spread.mean - half), min(high, spread.mean + half), count))
            low = high
        return out

    def sample(self, rng: random.Random, n: int) -> list[int]:
        """``n`` lengths (>= 1), scaled so that their expected mean is the histogram's (``whole``'s,
        where the draws are for one stretch of a recording: see there)."""
        ranges = self._bucket_ranges()
        weights = [c for _, _, c in ranges]
        scale = self._scale
        picks = rng.choices(ranges, weights=weights, k=n)
        return [max(1, round(scale * rng.uniform(lo, hi))) for lo, hi, _ in picks]
