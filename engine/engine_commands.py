"""What crosses into the engine thread (torch-free): the tokenized inputs, the typed commands the event
loop queues for it, and the protocol of the engine it drives. ``AsyncEngine`` runs the loop over them."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvpilot.engine.input_processor import CLIP_TO_CONTEXT, ContextRule, InputProcessor, NewRequest
from kvpilot.engine.outputs import RequestOutput
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.stats import SchedulerStats, StatLoggerBase

if TYPE_CHECKING:
    from kvpilot.engine.engine_config import EngineConfig
    from kvpilot.engine.scheduler import Scheduler


@dataclass
class PromptInput:
    """One engine request: already tokenized, with validated sampling parameters."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    # Clip max_tokens to the context, or refuse it naming these fields (the OpenAI server's rule).
    context: ContextRule = CLIP_TO_CONTEXT


@dataclass(frozen=True, slots=True)
class AddRequests:
    """Queue these requests, all or none; ``reply`` gets None, or the error that refused them."""

    inputs: tuple[PromptInput, ...]
    stream: bool
    reply: concurrent.futures.Future


@dataclass(frozen=True, slots=True)
class AbortRequests:
    """Stop these requests (unknown or finished ids are ignored); no reply."""

    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Reconfigure:
    """Apply a run-time settings update (``live_config.apply_update``), whole or not at all; ``reply``
    gets the settings in force after it, or the ``ConfigError``."""

    update: object
    reply: concurrent.futures.Future


# What the event loop sends the engine thread, on one queue, applied in order between two steps.
EngineCommand = AddRequests | AbortRequests | Reconfigure


class SteppedEngine(Protocol):
    """What ``AsyncEngine`` uses of the engine it drives (``LLMEngine`` is one): requests in, a step,
    aborts, the scheduler's state and its run-time knobs, health. Only the engine thread calls it."""

    engine_config: EngineConfig
    scheduler: Scheduler
    input_processor: InputProcessor
    stat_loggers: list[StatLoggerBase]
    num_steps: int
    num_cpu_blocks: int
    max_model_len: int
    max_num_batched_tokens: int

    def check_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        context: ContextRule = CLIP_TO_CONTEXT,
    ) -> NewRequest: ...

    def queue_request(self, new: NewRequest, stream: bool = False) -> None: ...

    def abort_request(self, request_ids: str | list[str]) -> int: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def stats(self) -> SchedulerStats: ...

    def check_health(self) -> None: ...
