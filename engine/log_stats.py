"""The periodic log line of a busy engine (``kvpilot serve``'s ``kvpilot.stats`` logger)."""

from __future__ import annotations

import logging
import time

from kvpilot.engine.stats import IterationStats, SchedulerStats, StatLoggerBase


class LoggingStatLogger(StatLoggerBase):
    """Logs throughput and cache state every ``interval_s`` seconds while the engine is busy, e.g.
    ``prompt 412.0 tok/s, generation 96.3 tok/s, running 12, waiting 0, KV cache 41.2%, ...``."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._last = time.monotonic()
        self._prompt = 0
        self._generation = 0
        self._preemptions_at_last = 0

    def record(self, sched: SchedulerStats, it: IterationStats | None) -> None:
        if it is None:
            return
        self._prompt += it.num_prefill_tokens
        self._generation += it.num_generation_tokens
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return
        elapsed = now - self._last
        hit_rate = sched.prefix_cache_hits / sched.prefix_cache_queries if sched.prefix_cache_queries else 0.0
        self.logger.info(
            "prompt %.1f tok/s, generation %.1f tok/s, running %d, waiting %d, KV cache %.1f%%, "
            "prefix-cache hit rate %.1f%%, preemptions %d (+%d)",
            self._prompt / elapsed,
            self._generation / elapsed,
            sched.num_running,
            sched.num_waiting,
            100.0 * sched.kv_cache_usage,
            100.0 * hit_rate,
            sched.num_preemptions_total,
            sched.num_preemptions_total - self._preemptions_at_last,
        )
        self._last = now
        self._prompt = self._generation = 0
        self._preemptions_at_last = sched.num_preemptions_total
