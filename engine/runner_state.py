"""The model runner's own copy of the requests it runs (torch-free).

The scheduler sends a request whole once (``NewRequestData``) and then only what changed
(``ScheduledRequest``: new output tokens, the tail of the block table). ``CachedRequests.update`` applies
one step's changes and returns each scheduled request's state, in the step's order; the runner flattens
its inputs and builds its sampling rows from these states, never from the scheduler's objects. Every
rank applies every step, so the copies on all ranks agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.engine.request import joined_slice
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.scheduler_output import SchedulerOutput


@dataclass(slots=True, eq=False)
class CachedRequestState:
    """What the runner holds of one request: its tokens, block table and sampling inputs."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams | None
    eos_token_id: int | None
    block_ids: list[int]
    # The sampler's penalty counts (``sampler.PenaltyCounts``), made at the first step that samples a
    # request with penalties and dropped with the request.
    penalties: object | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Prompt + output tokens ``[start:end]`` without joining the two lists."""
        return joined_slice(self.prompt_token_ids, self.output_token_ids, start, end)


class CachedRequests:
    """The requests a runner holds, by id; changed only by ``update``."""

    def __init__(self) -> None:
        self.states: dict[str, CachedRequestState] = {}

    def __len__(self) -> int:
        return len(self.states)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.states

    def update(self, out: SchedulerOutput) -> list[CachedRequestState]:
        """Forget ``out.finished_req_ids``, then apply each scheduled request's change: a new request
        replaces any state of its id, a known one gains its new tokens and the tail of its block table.
        Returns the scheduled requests' states in ``out.scheduled``'s order."""
        states = self.states
        for req_id in out.finished_req_ids:
            states.pop(req_id, None)
        scheduled = []
        append = scheduled.append
        for item in out.scheduled:
            new = item.new
            if new is None:
                state = states.get(item.req_id)
                if state is None:
                    raise RuntimeError(
                        f"step for request {item.req_id!r}, which this runner does not hold: a step "
                        "message was lost or applied out of order"
                    )
                if item.new_token_ids:
                    state.output_token_ids += item.new_token_ids
                blocks = state.block_ids
                cut = item.block_ids_from
                if cut > len(blocks):
                    raise RuntimeError(
                        f"request {item.req_id!r}: block table cut at {cut}, but this runner holds "
                        f"{len(blocks)} blocks of it"
                    )
                blocks[cut:] = item.new_block_ids
            else:
                state = CachedRequestState(
                    item.req_id,
                    new.prompt_token_ids,
                    list(new.output_token_ids),
                    new.sampling_params,
                    new.eos_token_id,
                    list(item.new_block_ids),
                )
                states[item.req_id] = state
            if item.start_pos + item.num_tokens > len(state.prompt_token_ids) + len(state.output_token_ids):
                raise RuntimeError(
                    f"request {item.req_id!r}: step feeds up to position {item.start_pos + item.num_tokens}"
                    f" but this runner holds {state.num_tokens} of its tokens"
                )
            append(state)
        return scheduled
