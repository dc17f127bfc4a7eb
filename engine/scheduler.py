"""Iteration-level continuous batching with chunked prefill and preemption (torch-free).

Every step fills a token budget of ``max_num_batched_tokens``:

1. running requests that are decoding (1 token each), oldest first;
2. running requests still part-way through their prompt (the next prefill chunk);
3. waiting requests, FCFS, while fewer than ``max_num_seqs`` run (their first chunk).

A request never distinguishes prefill from decode: it feeds ``num_tokens - num_computed_tokens`` tokens,
clipped to what is left of the budget. When a running request cannot get a KV block, the newest running
request is preempted:

* ``recompute``: its blocks are freed and it re-queues at the front of the waiting queue, to re-prefill
  prompt + generated tokens later;
* ``swap``: its blocks move to the CPU pool and it waits in the swapped queue; swapped requests resume
  (oldest first, before any waiting request is admitted) as soon as their blocks fit again. When the CPU
  pool is full the victim is recomputed instead (counted in ``num_swap_fallbacks``).

Parallel sampling (``n > 1``) shares the prompt: the first sequence prefills all but the last prompt
token, then its siblings fork from it (sharing every block by reference) and each computes the last
prompt token itself, copying the shared partial block on write.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvpilot.engine.block_manager import BlockManager
from kvpilot.engine.request import Request, RequestStatus
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
class RequestUpdate:
    """What one step did to one request: the token it sampled, and whether it finished."""

    request: Request
    new_token_id: int | None
    finished: bool


class Scheduler:
    """Decides, each step, which requests run and how many tokens each feeds."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0
        self.num_swap_fallbacks = 0

    # ------------------------------------------------------------------ intake
    def add_request(self, req: Request, siblings: list[Request] | None = None) -> None:
        """Queue ``req``; ``siblings`` (n > 1) will fork from it and share its prompt blocks.

        Raises ValueError if it can never run (longer than ``max_model_len``, bigger than the cache).
        """
        group = [req, *(siblings or [])]
        if len(group) > self.config.max_num_seqs:
            raise ValueError(
                f"n={len(group)} sequences exceed max_num_seqs ({self.config.max_num_seqs}); lower n"
            )
        for seq in group:
            self._validate(seq)
        for seq in group:
            seq.status = RequestStatus.WAITING
            self.requests[seq.req_id] = seq
        if siblings and req.num_prompt_tokens > 1:
            # Siblings wait for the prompt's KV: they fork from ``req`` once it is computed.
            req.pending_forks = list(siblings)
            for sib in siblings:
                sib.status = RequestStatus.FORK_PENDING
                sib.fork_parent = req
            self.waiting.append(req)
        else:
            self.waiting.extend(group)

    def _validate(self, req: Request) -> None:
        if req.req_id in self.requests:
            raise ValueError(f"duplicate request id {req.req_id!r}")
        if req.num_prompt_tokens == 0:
            raise ValueError("the prompt is empty: at least one token is required")
        if req.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"the prompt has {req.num_prompt_tokens} tokens but max_model_len is "
                f"{self.config.max_model_len}: at most {self.config.max_model_len - 1} prompt tokens "
                "fit with room for one generated token"
            )
        room = self.config.max_model_len - req.num_prompt_tokens
        max_tokens = req.sampling_params.max_tokens
        req.max_output_tokens = room if max_tokens is None else min(max_tokens, room)
        bm = self.block_manager
        # The last sampled token is never fed back, so a request holds at most prompt + max_output - 1 slots.
        peak = req.num_prompt_tokens + req.max_output_tokens - 1
        if bm.num_blocks_needed(peak) > bm.num_blocks:
            raise ValueError(
                f"the request needs up to {peak} tokens of KV cache ({req.num_prompt_tokens} prompt + "
                f"{req.max_output_tokens} output) but the whole cache holds {bm.num_blocks * bm.block_size} "
                "tokens; shorten the prompt or lower max_tokens"
            )

    def abort_requests(self, req_ids: Iterable[str]) -> list[Request]:
        """Stop these requests now and free their blocks. Unknown or finished ids are ignored."""
        return self.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish requests from outside the step (abort, stop string matched by the detokenizer)."""
        done = []
        for req_id in req_ids:
            req = self.requests.pop(req_id, None)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status == RequestStatus.SWAPPED:
                self.swapped.remove(req)
            elif req.status == RequestStatus.FORK_PENDING:
                req.fork_parent.pending_forks.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, status)
            done.append(req)
        return done

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        req.finished_time = time.monotonic()
        self.block_manager.free(req)
        if req.pending_forks:
            # The parent ends before sharing its prompt: its siblings go on by themselves.
            for sib in req.pending_forks:
                sib.fork_parent = None
                sib.status = RequestStatus.WAITING
                self.waiting.append(sib)
            req.pending_forks = []

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts; allocate their KV slots."""
        bm = self.block_manager
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, tuple[Request, int]] = {}
        preempted: list[str] = []

        active = [r for r in self.running if not r.is_paused]
        decodes = [r for r in active if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in active if r.num_tokens - r.num_computed_tokens > 1]
        for req in decodes + prefills:
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this step
                continue
            num_new = self._num_new_tokens(req, budget)
            while not bm.allocate_slots(req, num_new):
                victim = max(self.running, key=lambda r: r.arrival_seq)
                if victim.req_id in scheduled:
                    budget += scheduled.pop(victim.req_id)[1]
                self._preempt(victim)
                preempted.append(victim.req_id)
                if victim is req:
                    break
            else:
                scheduled[req.req_id] = (req, num_new)
                budget -= num_new

        # Resume swapped requests, then admit waiting ones -- unless this step had to preempt.
        if not preempted:
            budget = self._swap_in(budget, scheduled)
            budget = self._admit(budget, scheduled)

        items = []
        for req, num_new in scheduled.values():
            start = req.num_computed_tokens
            items.append(
                ScheduledRequest(
                    req_id=req.req_id,
                    token_ids=req.all_token_ids[start : start + num_new],
                    start_pos=start,
                    block_table=bm.block_tables[req.req_id],
                    do_sample=start + num_new == req.num_tokens,
                    sampling_params=req.sampling_params,
                    output_token_ids=req.output_token_ids,
                    prompt_token_ids=req.prompt_token_ids,
                    eos_token_id=req.eos_token_id,
                )
            )
        swap_out, swap_in = bm.take_pending_swaps()
        return SchedulerOutput(
            scheduled=items,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            blocks_to_swap_out=swap_out,
            blocks_to_copy=bm.take_pending_copies(),
            blocks_to_swap_in=swap_in,
            preempted_req_ids=preempted,
        )

    def _num_new_tokens(self, req: Request, budget: int) -> int:
        """Tokens ``req`` feeds this step: all it has not computed, within the budget -- and, while its
        siblings wait to fork, no further than the last prompt token (which each computes itself)."""
        end = req.num_tokens
        if req.pending_forks:
            end = req.num_prompt_tokens - 1
        return min(end - req.num_computed_tokens, budget)

    def _swap_in(self, budget: int, scheduled: dict[str, tuple[Request, int]]) -> int:
        bm = self.block_manager
        for req in list(self.swapped):
            if budget == 0 or self._num_seq_slots() + 1 + len(req.pending_forks) > self.config.max_num_seqs:
                break
            if req.is_paused:
                continue
            num_new = self._num_new_tokens(req, budget)
            if not self._make_room(lambda req=req, n=num_new: bm.can_swap_in(req, n)):
                break  # oldest first: younger swapped requests wait too
            bm.swap_in(req)
            allocated = bm.allocate_slots(req, num_new)
            assert allocated, "can_swap_in guaranteed room"
            self.swapped.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.req_id] = (req, num_new)
            budget -= num_new
        return budget

    def _admit(self, budget: int, scheduled: dict[str, tuple[Request, int]]) -> int:
        """Admit waiting requests in FCFS order (paused ones are passed over)."""
        bm = self.block_manager
        for req in list(self.waiting):
            if budget == 0 or self._num_seq_slots() + 1 + len(req.pending_forks) > self.config.max_num_seqs:
                break
            if req.is_paused:
                continue
            fresh = req.req_id not in bm.block_tables
            if fresh:
                bm.allocate_prefix(req)
            if req.pending_forks and req.num_computed_tokens == req.num_prompt_tokens - 1:
                self._fork_siblings(req)  # the prefix cache already holds all but the last token
            wanted = self._num_new_tokens(req, req.num_tokens)
            if not self.config.enable_chunked_prefill and wanted > budget:
                if fresh:
                    self._unadmit(req)
                break
            num_new = min(wanted, budget)
            if not self._make_room(lambda req=req, n=num_new: bm.allocate_slots(req, n)):
                if fresh:
                    self._unadmit(req)
                break
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
            self.running.append(req)
            scheduled[req.req_id] = (req, num_new)
            budget -= num_new
        return budget

    def _num_seq_slots(self) -> int:
        """Running sequences, counting the siblings that will fork from them (n > 1)."""
        return len(self.running) + sum(len(r.pending_forks) for r in self.running)

    def _make_room(self, fits) -> bool:
        """``fits()`` or, failing that, preempt paused running requests (newest first) until it does.

        Paused requests hold blocks but cannot run before others catch up (beam search): when those
        others need the room, the paused ones make way instead of deadlocking the step loop.
        """
        while not fits():
            paused = [r for r in self.running if r.is_paused]
            if not paused:
                return False
            self._preempt(max(paused, key=lambda r: r.arrival_seq))
        return True

    def _fork_siblings(self, parent: Request) -> None:
        """Fork ``parent``'s pending siblings: they share its blocks and join the running batch."""
        siblings, parent.pending_forks = parent.pending_forks, []
        for sib in siblings:
            sib.fork_parent = None
            self.fork(parent, sib)

    def fork(self, parent: Request, child: Request) -> None:
        """Start ``child`` from ``parent``'s computed state. ``child.all_token_ids`` must extend
        ``parent``'s first ``num_computed_tokens`` tokens. A running parent shares its blocks (copy on
        write); otherwise the child queues to compute its tokens itself."""
        if child.req_id not in self.requests:
            self._validate(child)
            self.requests[child.req_id] = child
        if parent.status == RequestStatus.RUNNING and parent.req_id in self.block_manager.block_tables:
            self.block_manager.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            child.status = RequestStatus.RUNNING
            if child.scheduled_time is None:
                child.scheduled_time = time.monotonic()
            self.running.append(child)
        else:
            child.num_computed_tokens = 0
            child.status = RequestStatus.WAITING
            self.waiting.appendleft(child)

    def _unadmit(self, req: Request) -> None:
        """Undo ``allocate_prefix`` for a request that stays waiting."""
        bm = self.block_manager
        bm.free(req)
        # The lookup is retried at its next admission attempt: count each admission once.
        if bm.enable_prefix_caching:
            bm.prefix_queries -= req.num_tokens
            bm.prefix_hits -= req.num_cached_tokens
        req.num_computed_tokens = 0
        req.num_cached_tokens = 0

    def _preempt(self, req: Request) -> None:
        """Swap ``req``'s KV to the CPU pool (swap mode, if it fits) or drop it to re-prefill later."""
        self.running.remove(req)
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        bm = self.block_manager
        if self.config.preemption_mode == "swap":
            if bm.can_swap_out(req):
                bm.swap_out(req)
                req.status = RequestStatus.SWAPPED
                self.swapped.appendleft(req)  # victims are newest first: the oldest ends up in front
                return
            self.num_swap_fallbacks += 1
        bm.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[RequestUpdate]:
        """Advance every scheduled request; append sampled tokens; finish those that stop.

        ``sampled`` maps req_id -> next token for every scheduled request with ``do_sample``.
        """
        updates = []
        now = time.monotonic()
        for item in output.scheduled:
            req = self.requests.get(item.req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens += len(item.token_ids)
            self.block_manager.cache_full_blocks(req)
            if req.pending_forks and req.num_computed_tokens == req.num_prompt_tokens - 1:
                self._fork_siblings(req)
            if not item.do_sample:
                continue
            token = sampled[item.req_id]
            req.append_output_token(token)
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            status = self._check_stop(req, token)
            if status is not None:
                del self.requests[req.req_id]
                self.running.remove(req)
                self._finish(req, status)
            updates.append(RequestUpdate(req, token, status is not None))
        return updates

    @staticmethod
    def _check_stop(req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens:
            if token == req.eos_token_id and not params.ignore_eos:
                req.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_output_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_swapped=len(self.swapped),
            kv_cache_usage=bm.usage,
            cpu_cache_usage=bm.cpu_usage,
            num_preemptions_total=self.num_preemptions_total,
            prefix_cache_queries=bm.prefix_queries,
            prefix_cache_hits=bm.prefix_hits,
            num_swap_fallbacks=self.num_swap_fallbacks,
        )
