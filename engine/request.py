"""Request state: the scheduler's own, written by it alone and read by the model runner's inputs
(torch-free). What leaves the core about a request is a ``CoreOutput`` of values.

A request is "prefill and decode as one thing": its tokens are the prompt then the generated ones, and
``num_computed_tokens``, how many of them already have KV in the cache. Each step the scheduler
feeds it the next ``num_tokens - num_computed_tokens`` tokens (a prefill chunk, or 1 while decoding).
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from kvpilot.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to be recomputed
    SWAPPED = "swapped"  # blocks in the CPU pool
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


_arrival_counter = itertools.count()


def output_cap(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> int:
    """The most tokens a request may generate: ``max_tokens`` (all the room when None) clipped so that
    prompt + output <= ``max_model_len``."""
    room = max_model_len - num_prompt_tokens
    return room if max_tokens is None else min(max_tokens, room)


@dataclass(eq=False)
class Request:
    """One sequence being generated. Only the scheduler writes its state; everyone else reads it."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # The id of the user request this sequence serves (defaults to req_id): the n > 1 siblings and the
    # requests of one beam search's rounds share it.
    client_request_id: str = ""
    # The effective output cap: max_tokens clipped so that prompt + output <= max_model_len.
    max_output_tokens: int = 0

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # FCFS priority: lower is earlier; the scheduler preempts the highest first.
    arrival_seq: int = field(default_factory=lambda: next(_arrival_counter))
    num_preemptions: int = 0
    # Tokens of the prompt whose KV came from the prefix cache at admission.
    num_cached_tokens: int = 0
    # When the scheduler first ran it (monotonic seconds), for the queue-time metrics.
    scheduled_time: float | None = None

    def __post_init__(self) -> None:
        self.client_request_id = self.client_request_id or self.req_id

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt and generated tokens, as a new list (O(num_tokens): the engine reads ``token_slice``)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without building the whole list: the prompt is shared by every
        sequence made from it (the n > 1 siblings), never copied into each."""
        return joined_slice(self.prompt_token_ids, self.output_token_ids, start, end)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.is_finished else None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)


def joined_slice(first: list[int], second: list[int], start: int, end: int) -> list[int]:
    """``(first + second)[start:end]`` without joining the two lists."""
    num_first = len(first)
    if end <= num_first:
        return first[start:end]
    if start >= num_first:
        return second[start - num_first : end - num_first]
    return first[start:] + second[: end - num_first]


def check_stop(req: Request, token: int) -> tuple[RequestStatus | None, int | None]:
    """Whether ``req`` stops now that ``token`` is its newest output token: (status, stop_reason) with
    status FINISHED_STOPPED on EOS (stop_reason None) or a stop token (stop_reason the token),
    FINISHED_LENGTH at its output cap, None to go on. ``min_tokens`` defers EOS and stop tokens."""
    params = req.sampling_params
    num_output = len(req.output_token_ids)
    if num_output >= params.min_tokens:
        if token == req.eos_token_id and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED, None
        if token in params.stop_token_id_set:
            return RequestStatus.FINISHED_STOPPED, token
    if num_output >= req.max_output_tokens:
        return RequestStatus.FINISHED_LENGTH, None
    return None, None
