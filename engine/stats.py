"""Per-step statistics the engine hands to its stat loggers (metrics exporters, benchmarks)."""

from __future__ import annotations

from dataclasses import dataclass, field


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

    @property
    def step_s(self) -> float:
        return self.schedule_s + self.prepare_s + self.forward_s + self.sample_s + self.update_s

    @property
    def overhead_s(self) -> float:
        """Everything outside the model forward: scheduling, input preparation, sampling, bookkeeping."""
        return self.step_s - self.forward_s
