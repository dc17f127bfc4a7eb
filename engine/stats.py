"""What the engine hands to its stat loggers after every step (metrics exporters, benchmarks), torch-free:
the scheduler's snapshot (``SchedulerStats``) and what the step did (``IterationStats``, built by
``make_iteration_stats``), through the one interface every logger implements (``StatLoggerBase``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpilot.engine.live_config import LiveConfig
    from kvpilot.engine.output_processor import StepRecord
    from kvpilot.engine.outputs import ModelRunnerOutput
    from kvpilot.engine.scheduler_output import SchedulerOutput


@dataclass
class SchedulerStats:
    """A snapshot for metrics, taken after each step."""

    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float  # 0..1
    cpu_cache_usage: float  # 0..1 (swap mode)
    num_preemptions_total: int
    prefix_cache_queries: int  # tokens looked up (cumulative)
    prefix_cache_hits: int  # tokens found (cumulative)
    num_swap_fallbacks: int = 0  # swap preemptions done as recompute because the CPU pool was full


@dataclass
class FinishedRequestStats:
    """Timing of one finished sequence (monotonic seconds), for latency histograms."""

    finish_reason: str
    num_prompt_tokens: int
    num_generation_tokens: int
    arrival_time: float
    scheduled_time: float | None
    first_token_time: float | None
    finished_time: float
    num_preemptions: int
    n: int = 1  # the request's ``n`` (its number of sequences)
    max_tokens: int | None = None  # the request's ``max_tokens``; None when it set none
    num_cached_tokens: int = 0  # prompt tokens the prefix cache held when its first token came


@dataclass
class IterationStats:
    """What one engine step did and how long its phases took (seconds)."""

    num_batched_tokens: int  # tokens fed to the model
    num_prefill_tokens: int  # of which prefill tokens (prompt chunks, and recomputation after preemption)
    num_prompt_tokens: int  # prompt lengths of the sequences that produced their first token this step
    num_generation_tokens: int  # tokens sampled
    num_running_seqs: int  # requests in the batch
    num_preemptions: int
    schedule_s: float
    prepare_s: float
    forward_s: float
    sample_s: float
    update_s: float  # scheduler update + detokenization + outputs
    # For each sampled token of a request that already had output: seconds since its previous token.
    inter_token_latencies: list[float] = field(default_factory=list)
    # Seconds from arrival to first token, for requests that produced their first token this step.
    time_to_first_tokens: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)
    # Of ``num_prompt_tokens``: those whose KV the prefix cache held when the sequence was scheduled.
    num_cached_prompt_tokens: int = 0
    # The step's shape as its cost depends on it (``SchedulerOutput``): sequences feeding more than one
    # token, the KV positions the one-token slices read, the causal pairs of the longer chunks.
    num_prefill_seqs: int = 0
    decode_context_tokens: int = 0
    prefill_attention_pairs: int = 0
    # Wall seconds this step held the engine: since the previous step ended when the engine had work
    # waiting since then (what a running sequence waits between two tokens), else from its own start.
    # None: not measured (the phase times alone).
    wall_s: float | None = None

    @property
    def step_s(self) -> float:
        return self.schedule_s + self.prepare_s + self.forward_s + self.sample_s + self.update_s

    @property
    def overhead_s(self) -> float:
        """Everything outside the model forward: scheduling, input preparation, sampling, bookkeeping."""
        return self.step_s - self.forward_s


def make_iteration_stats(
    sched_out: SchedulerOutput,
    runner_out: ModelRunnerOutput,
    record: StepRecord,
    num_preemptions: int,
    schedule_s: float,
    update_s: float,
    wall_s: float | None = None,
) -> IterationStats:
    """What one step did: token counts from ``sched_out`` and ``runner_out``, latencies and finished
    sequences from the output processor's ``record`` of the step, the runner's phase times and the
    core's own (``schedule_s``; ``update_s``: update, detokenization, outputs; ``wall_s``: see
    ``IterationStats.wall_s``)."""
    num_decode_tokens = sched_out.num_decode_tokens
    decode_context, prefill_pairs = sched_out.attention_shape()
    stats = IterationStats(
        num_batched_tokens=sched_out.num_batched_tokens,
        # Decode tokens are single tokens past the prompt; everything else is (re)prefill.
        num_prefill_tokens=sched_out.num_batched_tokens - num_decode_tokens,
        num_prompt_tokens=record.num_prompt_tokens,
        num_generation_tokens=len(runner_out.req_ids),
        num_running_seqs=len(sched_out.scheduled),
        num_preemptions=num_preemptions,
        schedule_s=schedule_s,
        prepare_s=runner_out.prepare_s,
        forward_s=runner_out.forward_s,
        sample_s=runner_out.sample_s,
        update_s=update_s,
        num_prefill_seqs=sched_out.num_prefill_seqs,
        decode_context_tokens=decode_context,
        prefill_attention_pairs=prefill_pairs,
        wall_s=wall_s,
    )
    stats.time_to_first_tokens += record.ttfts
    stats.inter_token_latencies += record.itls
    stats.finished += record.finished
    stats.num_cached_prompt_tokens = record.num_cached_prompt_tokens
    return stats


class StatLoggerBase(ABC):
    """A stat logger of the engine (``LLMEngine.stat_loggers``): the Prometheus exporter, the periodic
    log line, a benchmark's probe.

    ``record`` is called after every step with what it did, and between steps (``iteration_stats``
    None) when adds or aborts changed the scheduler's state. ``record_aborted`` counts sequences aborted
    from outside the engine (a client gone), ``record_errored`` those the engine failed, and
    ``record_live_config`` sees the run-time settings change and ``record_arrival`` each request
    queued; each does nothing unless a logger
    reports it.
    """

    @abstractmethod
    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats | None) -> None: ...

    def record_aborted(self, num_seqs: int) -> None:  # noqa: B027  (optional hook)
        pass

    def record_errored(self, num_seqs: int) -> None:  # noqa: B027  (optional hook)
        """``num_seqs`` sequences ended unfinished because the engine failed (its loop died)."""

    def record_live_config(self, live: LiveConfig) -> None:  # noqa: B027  (optional hook)
        pass

    def record_arrival(self, arrival_time: float) -> None:  # noqa: B027  (optional hook)
        """A request was queued; ``arrival_time`` is its arrival stamp (``time.monotonic()``)."""


class StepCallback(StatLoggerBase):
    """A stat logger from a function called with ``(scheduler_stats, iteration_stats)`` after every
    step (a benchmark's or a test's probe); the between-step refreshes are not passed on."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats | None) -> None:
        if iteration_stats is not None:
            self.fn(scheduler_stats, iteration_stats)
