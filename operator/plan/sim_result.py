"""What one simulated run predicts (torch-free): the engine's gauges after every step and the
requests' latencies, with the rates and quantiles ``kvpilot plan`` reports."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence


class SimulationError(ValueError):
    """The settings or the arrivals cannot be simulated; the message says why."""


@dataclasses.dataclass(slots=True)
class Sample:
    """The engine's gauges at the end of one step (simulated seconds from the start), and the
    preemptions and output tokens counted so far. ``num_waiting`` is the queue: waiting and swapped
    requests."""

    time: float
    kv_usage: float
    num_waiting: int
    num_running: int
    num_preemptions: int
    num_output_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class SimResult:
    """One run's predictions. Latencies in seconds; rates per simulated second over ``duration_s``
    (first arrival to the last step's end). ``start_s``: the first arrival's time on the arrivals'
    clock, where the samples' time 0 lies."""

    duration_s: float
    num_steps: int
    num_preemptions: int
    num_arrivals: int
    num_finished: int
    num_output_tokens: int
    samples: tuple[Sample, ...]
    ttft_s: tuple[float, ...]
    itl_s: tuple[float, ...]
    truncated: bool  # the run stopped at ``max_sim_s`` with requests still unfinished
    start_s: float = 0.0
    # The block manager's prefix-cache counters, in prompt tokens (vllm:prefix_cache_queries_total /
    # _hits_total): every admission's lookup, a recompute's included.
    prefix_queries: int = 0
    prefix_hits: int = 0

    @property
    def prefix_hit_rate(self) -> float | None:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else None

    @property
    def preemptions_per_s(self) -> float:
        return self.num_preemptions / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.duration_s if self.duration_s > 0 else 0.0

    def max_preemption_rate(self, window_s: float) -> float:
        """The highest preemption rate (per second) over any ``window_s`` ending at a step's end: the
        preemptions after the last step that ended ``window_s`` or more before it, over ``window_s``."""
        times = [0.0] + [s.time for s in self.samples]
        counts = [0] + [s.num_preemptions for s in self.samples]
        best = 0
        base = 0  # index of the last sample at least window_s before the current one
        for last in range(1, len(times)):
            while base + 1 < last and times[base + 1] <= times[last] - window_s:
                base += 1
            best = max(best, counts[last] - counts[base])
        return best / window_s

    def timeline(self, every_s: float = 1.0) -> list[dict[str, float | int]]:
        """The gauges over time: the first step ending in each ``every_s``, and the last step."""
        out: list[dict[str, float | int]] = []
        next_at = 0.0
        for index, s in enumerate(self.samples):
            if s.time >= next_at or index == len(self.samples) - 1:
                out.append(
                    {
                        "time_s": s.time,
                        "kv_usage": s.kv_usage,
                        "num_waiting": s.num_waiting,
                        "num_running": s.num_running,
                        "num_preemptions": s.num_preemptions,
                    }
                )
                next_at = (s.time // every_s + 1) * every_s
        return out

    def kv_usage(self, q: float) -> float:
        return quantile([s.kv_usage for s in self.samples], q)

    def queue_depth(self, q: float) -> float:
        return quantile([float(s.num_waiting) for s in self.samples], q)

    def ttft(self, q: float) -> float:
        return quantile(self.ttft_s, q)

    def itl(self, q: float) -> float:
        return quantile(self.itl_s, q)

    def summary(self) -> dict[str, float | int | bool]:
        """The figures ``kvpilot plan`` prints and writes (NaN where there is nothing to measure);
        KV usage and queue depth are taken at the end of every step (means over steps)."""
        return {
            "duration_s": self.duration_s,
            "num_steps": self.num_steps,
            "num_arrivals": self.num_arrivals,
            "num_finished": self.num_finished,
            "num_preemptions": self.num_preemptions,
            "preemptions_per_s": self.preemptions_per_s,
            "kv_usage_mean": mean([s.kv_usage for s in self.samples]),
            "kv_usage_p99": self.kv_usage(0.99),
            "queue_depth_mean": mean([float(s.num_waiting) for s in self.samples]),
            "queue_depth_p99": self.queue_depth(0.99),
            "ttft_p50_s": self.ttft(0.5),
            "ttft_p99_s": self.ttft(0.99),
            "itl_p50_s": self.itl(0.5),
            "itl_p99_s": self.itl(0.99),
            "output_tokens_per_s": self.output_tokens_per_s,
            "prefix_hit_rate": math.nan if self.prefix_hit_rate is None else self.prefix_hit_rate,
            "truncated": self.truncated,
        }


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (nearest rank) of ``values``; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan
