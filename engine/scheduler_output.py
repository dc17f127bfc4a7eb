"""The scheduler's contracts with the rest of the engine (torch-free): the knobs it obeys
(``SchedulerConfig``), what runs in one step (``SchedulerOutput``, read by the model runner) and what the
step did to each sequence (``CoreOutput``, values read by the output processor)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.engine.sampling_params import SamplingParams


@dataclass
class SchedulerConfig:
    """The knobs the scheduler obeys (validated by ``EngineArgs``)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"


@dataclass
class ScheduledRequest:
    """One request's slice of a step."""

    req_id: str
    token_ids: list[int]  # tokens fed this step, at positions start_pos .. start_pos + len - 1
    start_pos: int  # == num_computed_tokens before the step
    block_table: list[int]  # the request's physical blocks (shared list; read-only for the runner)
    do_sample: bool  # True when this slice reaches the end of the known tokens: sample the next one
    sampling_params: SamplingParams
    output_token_ids: list[int]  # generated so far (for penalties and seeds); read-only
    prompt_token_ids: list[int]  # read-only
    eos_token_id: int | None


@dataclass
class SchedulerOutput:
    """What runs in one step. The model runner reads only this."""

    scheduled: list[ScheduledRequest]  # decodes first, then prefill chunks
    num_batched_tokens: int  # sum of len(token_ids)
    # Block operations, executed before the forward in this order: swap out, copy, swap in.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) pairs
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    preempted_req_ids: list[str] = field(default_factory=list)

    @property
    def has_block_ops(self) -> bool:
        return bool(self.blocks_to_swap_out or self.blocks_to_copy or self.blocks_to_swap_in)

    @property
    def is_empty(self) -> bool:
        """Nothing to run and no block to move."""
        return not self.scheduled and not self.has_block_ops


@dataclass(frozen=True, slots=True)
class CoreOutput:
    """What one step did to one sequence, as values only (picklable, sharing nothing with the
    scheduler's state): the token it sampled, its logprobs, and whether it finished and why.

    The metric fields are events the core alone sees: when it first scheduled the sequence, how many
    prompt tokens came from the prefix cache, how often it was preempted."""

    req_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None  # aligned with new_token_ids; None unless requested
    finish_reason: str | None = None  # "stop" | "length" | None while running
    stop_reason: int | None = None  # the stop token id that ended it
    scheduled_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
