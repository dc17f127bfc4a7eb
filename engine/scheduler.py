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
  (in queue order, before any waiting request is admitted) as soon as their blocks fit again, and while
  one does not fit no waiting request is admitted, so that newer requests cannot starve it. When the
  CPU pool is full the victim is recomputed instead (counted in ``num_swap_fallbacks``).

The queues remove any request in O(1) (``RequestQueue``), so aborts never scan them.

Parallel sampling (``n > 1``) is not the scheduler's concern: the input processor fans a request out
into ``n`` independent sequences, queued together. They share their prompt's full blocks through the
prefix cache (the first one admitted keys them as it allocates them; the others, admitted after it in
the same step, reuse them), and each computes its last partial block itself.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable

from kvpilot.engine.block_manager import BlockManager
from kvpilot.engine.outputs import ModelRunnerOutput
from kvpilot.engine.request import Request, RequestStatus, check_stop, output_cap
from kvpilot.engine.request_queue import RequestQueue
from kvpilot.engine.scheduler_output import (
    CoreOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerConfig,
    SchedulerOutput,
)
from kvpilot.engine.stats import SchedulerStats


class Scheduler:
    """Decides, each step, which requests run and how many tokens each feeds."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        # FCFS queues with O(1) removal: aborting queued requests never scans them.
        self.waiting = RequestQueue()
        self.running: list[Request] = []
        self.swapped = RequestQueue()
        # Every unfinished request by req_id: the one place a request's identity lives.
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0
        self.num_swap_fallbacks = 0
        # What the model runner holds: req_id -> how many output tokens it was sent. A request leaving
        # it (finished, aborted, preempted, swapped out) is named in the next step's finished_req_ids.
        self._runner_outputs: dict[str, int] = {}
        self._runner_forget: list[str] = []

    # ------------------------------------------------------------------ intake
    def add_request(self, req: Request) -> None:
        """Queue ``req``, which comes checked (``InputProcessor``: the prompt fits ``max_model_len`` and
        the whole cache); here it gets its output cap."""
        # Ids are unique by construction (the input processor refuses a live sequence id); a clash here
        # would overwrite a live request and leak its blocks.
        assert req.req_id not in self.requests, f"request id {req.req_id!r} is already queued"
        req.max_output_tokens = output_cap(
            req.num_prompt_tokens, req.sampling_params.max_tokens, self.config.max_model_len
        )
        req.status = RequestStatus.WAITING
        self.requests[req.req_id] = req
        self.waiting.append(req)

    def abort_requests(self, req_ids: Iterable[str]) -> list[Request]:
        """Stop these requests now and free their blocks. Unknown or finished ids are ignored."""
        return self.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, req_ids: Iterable[str], status: RequestStatus) -> list[Request]:
        """Finish requests from outside the step (abort, a stop string matched by the detokenizer) and
        free their blocks. Unknown or finished ids are ignored; returns the requests finished."""
        done = []
        for req_id in req_ids:
            req = self.requests.pop(req_id, None)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status == RequestStatus.SWAPPED:
                self.swapped.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, status)
            done.append(req)
        return done

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.block_manager.free(req)
        self._leave_runner(req)

    def reconfigure(self, max_num_seqs: int, max_num_batched_tokens: int, preemption_mode: str) -> None:
        """New bounds and preemption mode from the next step on (validated by ``live_config``). Running
        requests above a lowered ``max_num_seqs`` are preempted by that step; requests already swapped
        out resume as before whatever the mode."""
        self.config = dataclasses.replace(
            self.config,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            preemption_mode=preemption_mode,
        )

    # ------------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts; allocate their KV slots."""
        bm = self.block_manager
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, tuple[Request, int]] = {}
        preempted: list[str] = []

        # A max_num_seqs lowered at run time takes effect at once: the newest running requests make way,
        # as preemption victims do (re-queued or swapped, never dropped).
        while len(self.running) > self.config.max_num_seqs:
            victim = max(self.running, key=lambda r: r.arrival_seq)
            self._preempt(victim)
            preempted.append(victim.req_id)

        # (request, tokens it has not computed): decodes first, then prefill chunks, each oldest first.
        decodes: list[tuple[Request, int]] = []
        prefills: list[tuple[Request, int]] = []
        for r in self.running:
            left = len(r.prompt_token_ids) + len(r.output_token_ids) - r.num_computed_tokens
            if left == 1:
                decodes.append((r, 1))
            elif left > 1:
                prefills.append((r, left))
        running = RequestStatus.RUNNING
        for req, left in decodes + prefills:
            if budget == 0:
                break
            if req.status is not running:  # preempted earlier in this step
                continue
            num_new = min(left, budget)
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

        # Resume swapped requests (oldest first), then admit waiting ones (FCFS) -- unless this step had
        # to preempt. A swapped request that does not fit yet keeps the waiting ones out: they would take
        # the blocks it waits for, and a steady arrival of short requests would starve it for ever.
        if not preempted:
            budget, blocked = self._start_queued(self.swapped, budget, scheduled, self._allocate_swapped)
            if not blocked:
                budget, _ = self._start_queued(self.waiting, budget, scheduled, self._allocate_waiting)

        items, num_decode_tokens = self._runner_deltas(scheduled.values())
        swap_out, swap_in = bm.take_pending_swaps()
        bm.end_step()  # every block allocated so far is computed by this step's forward
        forget, self._runner_forget = self._runner_forget, []
        return SchedulerOutput(
            scheduled=items,
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            blocks_to_swap_out=swap_out,
            blocks_to_copy=bm.take_pending_copies(),
            blocks_to_swap_in=swap_in,
            preempted_req_ids=preempted,
            finished_req_ids=forget,
            num_decode_tokens=num_decode_tokens,
        )

    def _runner_deltas(self, scheduled: Iterable[tuple[Request, int]]) -> tuple[list[ScheduledRequest], int]:
        """Each request's slice of the step as a change to what the runner holds of it: everything when
        the runner does not hold it; else its output tokens since the last send and its block table from
        the block this step first writes into (the earlier ones are full and never change; that one may
        have been replaced by a copy on write). Also returns the step's decode tokens (single tokens fed
        past the prompt), counted on the way."""
        tables = self.block_manager.block_tables
        bs = self.block_manager.block_size
        sent_outputs = self._runner_outputs
        items = []
        num_decode_tokens = 0
        for req, num_new in scheduled:
            req_id = req.req_id
            start = req.num_computed_tokens
            outputs = req.output_token_ids
            num_prompt = len(req.prompt_token_ids)
            table = tables[req_id]
            sent = sent_outputs.get(req_id)
            sent_outputs[req_id] = len(outputs)
            do_sample = start + num_new == num_prompt + len(outputs)
            num_decode_tokens += num_new == 1 and start >= num_prompt
            if sent is None:
                new = NewRequestData(
                    req.prompt_token_ids, list(outputs), req.sampling_params, req.eos_token_id
                )
                items.append(ScheduledRequest(req_id, start, num_new, do_sample, [], 0, list(table), new))
            else:
                cut = start // bs
                items.append(
                    ScheduledRequest(req_id, start, num_new, do_sample, outputs[sent:], cut, table[cut:])
                )
        return items, num_decode_tokens

    def _leave_runner(self, req: Request) -> None:
        """``req`` frees its blocks: the runner forgets it with the next step."""
        if self._runner_outputs.pop(req.req_id, None) is not None:
            self._runner_forget.append(req.req_id)

    @staticmethod
    def _num_new_tokens(req: Request, budget: int) -> int:
        """Tokens ``req`` feeds this step: all it has not computed, within the budget."""
        return min(req.num_tokens - req.num_computed_tokens, budget)

    def _start_queued(
        self,
        queue: RequestQueue,
        budget: int,
        scheduled: dict[str, tuple[Request, int]],
        allocate: Callable[[Request, int], int | None],
    ) -> tuple[int, bool]:
        """Start ``queue``'s requests in order while ``allocate(req, budget)`` finds them room: it returns
        the number of tokens the request feeds, or None to stop at it. Returns the budget left and
        whether a request had to stay queued."""
        # The walk stops at the first request that cannot start, so a long queue costs nothing here.
        for req in queue:
            if not self._can_join(req, budget):
                return budget, True
            num_new = allocate(req, budget)
            if num_new is None:
                return budget, True  # first come, first served: the requests behind it wait too
            self._start_running(req, queue)
            scheduled[req.req_id] = (req, num_new)
            budget -= num_new
        return budget, False

    def _allocate_swapped(self, req: Request, budget: int) -> int | None:
        bm = self.block_manager
        num_new = self._num_new_tokens(req, budget)
        if not bm.can_swap_in(req, num_new):
            return None
        bm.swap_in(req)
        allocated = bm.allocate_slots(req, num_new)
        assert allocated, "can_swap_in guaranteed room"
        return num_new

    def _allocate_waiting(self, req: Request, budget: int) -> int | None:
        bm = self.block_manager
        fresh = not bm.has_block_table(req.req_id)
        if fresh and not bm.enable_prefix_caching:
            # Nothing can be cached: whether the request fits is known before touching the pool. A queue
            # head that does not fit is asked again every step, so this check is the common case of a
            # full pool; what it decides is what allocating and undoing would (no block, no counter).
            wanted = req.num_tokens
            if (not self.config.enable_chunked_prefill and wanted > budget) or bm.num_blocks_needed(
                min(wanted, budget)
            ) > bm.num_free_blocks:
                req.num_computed_tokens = req.num_cached_tokens = 0
                return None
        if fresh:
            req.num_computed_tokens = req.num_cached_tokens = bm.allocate_prefix(req)
        wanted = self._num_new_tokens(req, req.num_tokens)
        num_new = min(wanted, budget)
        # Without chunked prefill a prompt waits for a budget that holds it whole.
        too_big = not self.config.enable_chunked_prefill and wanted > budget
        if too_big or not bm.allocate_slots(req, num_new):
            if fresh:
                self._unadmit(req)
            return None
        return num_new

    def _can_join(self, req: Request, budget: int) -> bool:
        """Whether the budget and ``max_num_seqs`` leave room for ``req``."""
        return budget > 0 and len(self.running) < self.config.max_num_seqs

    def _start_running(self, req: Request, queue: RequestQueue | None = None) -> None:
        if queue is not None:
            queue.remove(req)
        req.status = RequestStatus.RUNNING
        if req.scheduled_time is None:
            req.scheduled_time = time.monotonic()
        self.running.append(req)

    def _unadmit(self, req: Request) -> None:
        """Undo ``allocate_prefix`` for a request that stays waiting."""
        self.block_manager.undo_allocate_prefix(req)
        req.num_computed_tokens = 0
        req.num_cached_tokens = 0

    def _preempt(self, req: Request) -> None:
        """Swap ``req``'s KV to the CPU pool (swap mode, if it fits) or drop it to re-prefill later."""
        self.running.remove(req)
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self._leave_runner(req)
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

    def update_from_output(
        self, output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[CoreOutput]:
        """Advance every scheduled request by the step ``output`` described; append the tokens
        ``runner_output`` sampled; finish those that stop. The only writer of this state.

        ``runner_output`` holds a token for every scheduled request with ``do_sample``. Requests
        aborted while the step ran are skipped. Returns one ``CoreOutput`` (values only) per token
        appended.
        """
        req_ids = runner_output.req_ids
        token_ids = runner_output.token_ids
        logprobs = runner_output.logprobs
        if not len(req_ids) == len(token_ids) == len(logprobs):
            raise ValueError(
                f"runner output is ragged: {len(req_ids)} req_ids, {len(token_ids)} token_ids, "
                f"{len(logprobs)} logprobs"
            )
        position = {req_id: i for i, req_id in enumerate(req_ids)}
        requests = self.requests
        running = RequestStatus.RUNNING
        outputs = []
        for item in output.scheduled:
            req = requests.get(item.req_id)
            if req is None or req.status is not running:
                continue  # aborted while the step ran
            req.num_computed_tokens += item.num_tokens  # its full blocks were keyed as allocated
            if not item.do_sample:
                continue
            i = position[item.req_id]
            token = token_ids[i]
            req.append_output_token(token)
            entry = logprobs[i]
            status, stop_reason = check_stop(req, token)
            if status is not None:
                del self.requests[req.req_id]
                self.running.remove(req)
                self._finish(req, status)
            outputs.append(
                CoreOutput(
                    req.req_id,
                    [token],
                    None if entry is None else [entry],
                    finish_reason=None if status is None else status.value,
                    stop_reason=stop_reason,
                    scheduled_time=req.scheduled_time,
                    num_cached_tokens=req.num_cached_tokens,
                    num_preemptions=req.num_preemptions,
                )
            )
        return outputs

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
