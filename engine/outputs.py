"""What the engine returns for a request (mirrors vLLM's ``RequestOutput``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sequence of a request (``n > 1`` gives several)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # Per output token: {token_id: logprob}, the sampled token first (when logprobs were requested).
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Monotonic timestamps (seconds) of a request's life."""

    arrival_time: float
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0


@dataclass
class RequestOutput:
    """One output of a request. For a streaming request each output carries only what is new since the
    previous one: its completions' ``text``, ``token_ids`` and ``logprobs`` are the deltas (the same
    lists as ``delta_text`` / ``delta_token_ids``), ``cumulative_logprob`` is the running total. A
    non-streaming request gets a single, final output with everything."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # The text / token ids added since the previous output, per completion (all of them when not streaming).
    delta_text: list[str] = field(default_factory=list)
    delta_token_ids: list[list[int]] = field(default_factory=list)


@dataclass
class ModelRunnerOutput:
    """What the model runner returns for one step (torch-free, picklable): the tokens sampled, as aligned
    lists over the requests that sampled, with their logprobs (None where none were asked for)."""

    req_ids: list[str]
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]
    # Wall time of the phases (seconds). On CUDA the forward is asynchronous: its time lands in sample_s.
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
