"""Model-free builders for the scheduler and block manager tests (no torch anywhere in here).

``FakeModel`` stands in for the model runner: it keeps its own copy of the requests from the step
messages alone (``CachedRequests``, as the runner does) and checks it against the scheduler's every step,
computes slots from those block tables exactly like ``ModelRunner.prepare_inputs`` does, keeps a shadow
KV cache (each slot remembers the token prefix whose
KV it holds), checks that every request attends over KV that really is its own prefix, and samples a
deterministic pseudo-random token that is never EOS unless told to.
"""

from __future__ import annotations

import itertools
import zlib
from collections import Counter

from kvpilot.engine.block_manager import BlockManager
from kvpilot.engine.outputs import ModelRunnerOutput
from kvpilot.engine.request import Request
from kvpilot.engine.runner_state import CachedRequests
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.scheduler import Scheduler
from kvpilot.engine.scheduler_output import SchedulerConfig, SchedulerOutput

EOS = 0
VOCAB = 50

_ids = itertools.count()


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 32,
    max_model_len: int = 128,
    enable_prefix_caching: bool = False,
    enable_chunked_prefill: bool = True,
    preemption_mode: str = "recompute",
    num_cpu_blocks: int = 0,
) -> Scheduler:
    """A scheduler over a fresh block manager (with a CPU pool of ``num_cpu_blocks`` for swap mode)."""
    bm = BlockManager(
        num_blocks, block_size, enable_prefix_caching=enable_prefix_caching, num_cpu_blocks=num_cpu_blocks
    )
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        preemption_mode=preemption_mode,
    )
    return Scheduler(config, bm)


def make_request(
    prompt: int | list[int] = 8,
    req_id: str | None = None,
    eos_token_id: int | None = EOS,
    **params,
) -> Request:
    """A request with ``prompt`` tokens (a length gives tokens 1..n, never EOS) and sampling ``params``
    (``max_tokens`` defaults to 4)."""
    tokens = list(range(1, prompt + 1)) if isinstance(prompt, int) else list(prompt)
    params.setdefault("max_tokens", 4)
    return Request(
        req_id=req_id if req_id is not None else f"r{next(_ids)}",
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(**params),
        eos_token_id=eos_token_id,
    )


def make_requests(prompt_lens: list[int], prefix: str = "r", **params) -> list[Request]:
    """One request per prompt length, ids ``{prefix}0, {prefix}1, ...`` in arrival order."""
    return [make_request(n, req_id=f"{prefix}{i}", **params) for i, n in enumerate(prompt_lens)]


def fake_token(req: Request) -> int:
    """Deterministic pseudo-random next token for ``req`` (never EOS)."""
    key = f"{req.req_id}:{req.num_tokens}".encode()
    return 1 + zlib.crc32(key) % (VOCAB - 1)


def slots_of(out: SchedulerOutput, bm: BlockManager) -> list[int]:
    """The slot mapping of ``out`` (from the block manager's tables, which the runner's copies must
    equal: ``FakeModel`` checks that)."""
    bs = bm.block_size
    slots = []
    for item in out.scheduled:
        table = bm.get_block_table(item.req_id)
        slots.extend(
            table[p // bs] * bs + p % bs for p in range(item.start_pos, item.start_pos + item.num_tokens)
        )
    return slots


class FakeModel:
    """Runs a step against a shadow KV cache and samples fake tokens.

    ``kv[slot]`` is the token prefix (as a tuple) whose last token's KV the slot holds. Before a
    request's slice is "computed", every earlier position must read back exactly its own prefix: that
    catches blocks shared between different prefixes, stale copies and overwritten blocks.
    """

    def __init__(self, block_size: int, token_fn=fake_token) -> None:
        self.block_size = block_size
        self.kv: dict[int, tuple[int, ...]] = {}
        self.cpu_kv: dict[int, tuple[int, ...]] = {}  # the swap pool, same slot numbering
        self.token_fn = token_fn
        # The runner's own copy of the requests, kept from the step messages alone; every step it is
        # checked against the scheduler's requests and the block manager's tables.
        self.requests = CachedRequests()
        self.fed: dict[str, list[int]] = {}  # the tokens each request fed in the last step

    def _move(self, src_kv: dict, dst_kv: dict, mapping: list[tuple[int, int]]) -> None:
        """Copy whole blocks (all sources read before any destination is written)."""
        bs = self.block_size
        moved = {}
        for src, dst in mapping:
            for off in range(bs):
                moved[dst * bs + off] = src_kv.get(src * bs + off)
        for slot, value in moved.items():
            if value is None:
                dst_kv.pop(slot, None)
            else:
                dst_kv[slot] = value

    def execute(self, sched: Scheduler, out: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.block_size
        dsts = [d for _, d in out.blocks_to_copy]
        assert len(dsts) == len(set(dsts)), f"two copies into one block: {out.blocks_to_copy}"
        # The runner's order: swap out, copy on write, swap in.
        self._move(self.kv, self.cpu_kv, out.blocks_to_swap_out)
        self._move(self.kv, self.kv, out.blocks_to_copy)
        self._move(self.cpu_kv, self.kv, out.blocks_to_swap_in)
        sampled = {}
        states = self.requests.update(out)
        # The runner forgets exactly the requests that left it: it holds only running ones.
        assert set(self.requests.states) <= {r.req_id for r in sched.running}
        self.fed = {}
        for item, state in zip(out.scheduled, states, strict=True):
            req = sched.requests[item.req_id]
            table = state.block_ids
            tokens = req.all_token_ids
            # The runner's copy, rebuilt from the deltas, is the scheduler's request.
            assert state.prompt_token_ids + state.output_token_ids == tokens, f"{item.req_id} tokens differ"
            assert table == sched.block_manager.get_block_table(item.req_id), f"{item.req_id} table differs"
            assert state.sampling_params is req.sampling_params
            fed = state.token_slice(item.start_pos, item.start_pos + item.num_tokens)
            assert fed == tokens[item.start_pos : item.start_pos + item.num_tokens]
            self.fed[item.req_id] = fed
            assert item.start_pos == req.num_computed_tokens
            for p in range(item.start_pos):  # attend over everything cached for this request
                slot = table[p // bs] * bs + p % bs
                assert self.kv.get(slot) == tuple(tokens[: p + 1]), (
                    f"{item.req_id} position {p} reads KV of another prefix from slot {slot}"
                )
            for p in range(item.start_pos, item.start_pos + item.num_tokens):
                self.kv[table[p // bs] * bs + p % bs] = tuple(tokens[: p + 1])
            if item.do_sample:
                sampled[item.req_id] = self.token_fn(req)
        return ModelRunnerOutput(list(sampled), list(sampled.values()), [None] * len(sampled))


def snapshot(sched: Scheduler) -> dict[str, int]:
    """Before ``schedule()``: each running request's id -> tokens it still has to feed."""
    return {r.req_id: r.num_tokens - r.num_computed_tokens for r in sched.running}


def check_step(sched: Scheduler, out: SchedulerOutput, before: dict[str, int]) -> None:
    """Invariants that hold right after ``schedule()``; ``before`` is ``snapshot()`` taken before it."""
    bm = sched.block_manager
    bs = bm.block_size
    cfg = sched.config
    assert out.num_batched_tokens == sum(i.num_tokens for i in out.scheduled)
    assert 0 <= out.num_batched_tokens <= cfg.max_num_batched_tokens
    assert len(sched.running) <= cfg.max_num_seqs
    ids = [i.req_id for i in out.scheduled]
    assert len(ids) == len(set(ids))
    running_ids = {r.req_id for r in sched.running}
    assert set(ids) <= running_ids, "a scheduled request is not running"
    assert not set(out.preempted_req_ids) & set(ids)
    # Order: running decodes, then running prefill chunks, then newly admitted requests.
    rank = [0 if before.get(i) == 1 else 1 if i in before else 2 for i in ids]
    assert rank == sorted(rank), f"out of order (0 decode, 1 prefill chunk, 2 admitted): {rank}"
    slots = slots_of(out, bm)
    assert len(slots) == len(set(slots)), "a slot is written twice in one step"
    for item in out.scheduled:
        end = item.start_pos + item.num_tokens
        assert item.num_tokens >= 1
        # On demand: exactly the blocks needed for the tokens computed after this step.
        assert len(bm.get_block_table(item.req_id)) == -(-end // bs)
        assert item.do_sample == (end == sched.requests[item.req_id].num_tokens)
    check_blocks(sched, {item.req_id: item.num_tokens for item in out.scheduled})


def check_blocks(sched: Scheduler, scheduled: dict[str, int] | None = None) -> None:
    """Block accounting: ref counts equal table memberships; free lists hold exactly the unreferenced;
    every running request holds exactly the blocks its computed (+ ``scheduled``) tokens need."""
    bm = sched.block_manager
    holders = Counter(b for table in bm.block_tables.values() for b in table)
    for block in range(bm.num_blocks):
        assert bm.ref_counts[block] >= 0
        assert bm.ref_counts[block] == holders[block], (
            f"block {block}: ref count {bm.ref_counts[block]} but held by {holders[block]} tables"
        )
    free = list(bm._free_plain) + list(bm._free_cached)
    assert len(free) == len(set(free)), "a block is on a free list twice"
    assert set(free) == {b for b in range(bm.num_blocks) if bm.ref_counts[b] == 0}
    assert bm.num_free_blocks == bm.num_blocks - len(holders)
    # Only live requests hold tables; waiting ones hold none; swapped ones hold CPU blocks only.
    assert set(bm.block_tables) <= {r.req_id for r in sched.running}
    assert set(bm.cpu_tables) == {r.req_id for r in sched.swapped}
    cpu_held = [b for table in bm.cpu_tables.values() for b in table]
    assert len(cpu_held) == len(set(cpu_held)), "a CPU block is held twice"
    cpu_free = list(bm._free_cpu) + list(bm._cpu_released)
    assert not set(cpu_held) & set(cpu_free) and len(cpu_held) + len(cpu_free) == bm.num_cpu_blocks
    scheduled = scheduled or {}
    for req in sched.running:
        num_tokens = req.num_computed_tokens + scheduled.get(req.req_id, 0)
        assert len(bm.block_tables[req.req_id]) == -(-num_tokens // bm.block_size)


def run_to_completion(
    sched: Scheduler, model: FakeModel | None = None, max_steps: int = 10_000, outputs: list | None = None
) -> int:
    """Step until nothing is left, checking invariants; returns the number of steps. ``outputs``, when
    given, collects every ``CoreOutput``."""
    model = model or FakeModel(sched.block_manager.block_size)
    for step in range(max_steps):
        if not sched.requests:
            return step
        before = snapshot(sched)
        out = sched.schedule()
        check_step(sched, out, before)
        sampled = model.execute(sched, out)
        core_outputs = sched.update_from_output(out, sampled)
        if outputs is not None:
            outputs += core_outputs
        check_blocks(sched)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")
