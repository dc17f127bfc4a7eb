"""The scheduler's contracts with the rest of the engine (torch-free): the knobs it obeys
(``SchedulerConfig``), what runs in one step (``SchedulerOutput``, read by the model runner) and what the
step did to each sequence (``CoreOutput``, values read by the output processor).

A step is sent as a change to the runner's state: a request's prompt, parameters and block table cross
once (``NewRequestData``), and each later step carries only its new tokens and blocks and the ids to
forget. Every rank of a parallel engine is sent every step, so each rank's copy stays the same."""

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


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """Everything the model runner keeps about a request, sent once: when the request is first scheduled,
    and again after a preemption (recomputed or swapped out, it left the runner's state)."""

    prompt_token_ids: list[int]  # shared with the scheduler's request, never written
    output_token_ids: list[int]  # a copy: the tokens generated before a preemption, else []
    sampling_params: SamplingParams | None  # None on a rank that does not sample
    eos_token_id: int | None


@dataclass(slots=True)
class ScheduledRequest:
    """One request's slice of a step, as a change to what the runner already holds of it
    (``runner_state.CachedRequests``): the tokens it feeds come from the runner's copy of the request's
    tokens, its block table from the runner's copy of the table. Not frozen only because a frozen
    dataclass costs twice as much to build, once per request per step; nothing writes it.

    A decode step of a known request carries its newest output token and the id of the block it writes
    into; nothing else of the request is sent again."""

    req_id: str
    start_pos: int  # == num_computed_tokens before the step
    num_tokens: int  # tokens fed this step, at positions start_pos .. start_pos + num_tokens - 1
    do_sample: bool  # True when this slice reaches the end of the known tokens: sample the next one
    # Output tokens generated since the runner last heard of the request (the previous step's sample).
    new_token_ids: list[int]
    # The runner's block table is cut at ``block_ids_from`` and ``new_block_ids`` appended: blocks
    # before the one this step first writes into never change (a copy-on-write replaces that one).
    block_ids_from: int
    new_block_ids: list[int]
    new: NewRequestData | None = None  # set when the runner does not hold the request


@dataclass
class SchedulerOutput:
    """What runs in one step. The model runner reads only this."""

    scheduled: list[ScheduledRequest]  # decodes first, then prefill chunks
    num_batched_tokens: int  # sum of num_tokens
    # Block operations, executed before the forward in this order: swap out, copy, swap in.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, cpu block)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) pairs
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu block, device block)
    preempted_req_ids: list[str] = field(default_factory=list)
    # Requests the runner must forget before this step (finished, aborted, preempted or swapped out
    # since the previous step it was sent): a request scheduled again later comes back as new.
    finished_req_ids: list[str] = field(default_factory=list)
    # Single tokens fed past the prompt (decode tokens, for the metrics); the rest of the batch is
    # prefill or recompute.
    num_decode_tokens: int = 0

    @property
    def num_prefill_seqs(self) -> int:
        """Sequences that feed more than one token this step (a prompt chunk or a recomputation). The
        cost model counts by shape: a one-token slice costs what a decode costs, whatever its phase."""
        return sum(1 for r in self.scheduled if r.num_tokens > 1)

    @property
    def decode_context_tokens(self) -> int:
        """The KV positions the one-token slices attend to, summed: a token at position ``p`` reads
        ``p + 1`` of them. What attention costs in a decode step grows with this."""
        return self.attention_shape()[0]

    @property
    def prefill_attention_pairs(self) -> int:
        """(query, key) pairs the longer chunks attend over, causal: a chunk of ``n`` tokens at
        ``start`` adds ``n * start + n * (n + 1) / 2``. Quadratic in a prompt's length, which is why a
        long prompt's prefill costs more than its token count says."""
        return self.attention_shape()[1]

    def attention_shape(self) -> tuple[int, int]:
        """(``decode_context_tokens``, ``prefill_attention_pairs``), in one pass over the batch."""
        context = pairs = 0
        for r in self.scheduled:
            n = r.num_tokens
            if n == 1:
                context += r.start_pos + 1
            else:
                pairs += n * r.start_pos + n * (n + 1) // 2
        return context, pairs

    @property
    def has_block_ops(self) -> bool:
        return bool(self.blocks_to_swap_out or self.blocks_to_copy or self.blocks_to_swap_in)

    @property
    def is_empty(self) -> bool:
        """Nothing to run, no block to move and nothing for the runner to forget."""
        return not self.scheduled and not self.has_block_ops and not self.finished_req_ids


@dataclass(slots=True)
class CoreOutput:
    """What one step did to one sequence, as values only (picklable, sharing nothing with the
    scheduler's state): the token it sampled, its logprobs, and whether it finished and why. Not frozen
    for the reason ``ScheduledRequest`` is not: one is built per sequence per step, and a frozen one
    costs four times as much (1.06 against 0.23 us); nothing writes it.

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
