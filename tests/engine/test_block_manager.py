"""BlockManager without a model: on-demand allocation, ref counts, prefix caching, fork + copy-on-write."""

from __future__ import annotations

import subprocess
import sys
import zlib
from collections import Counter

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvpilot.engine.block_manager import BlockManager

from .conftest import make_request


def compute(bm: BlockManager, req, num_new: int) -> None:
    """What one step does to a request: allocate slots, 'compute' them, register full blocks."""
    assert bm.allocate_slots(req, num_new)
    bm.end_step()
    req.num_computed_tokens += num_new


def lookup(bm: BlockManager, req) -> int:
    """The prefix-cache lookup at admission, recorded in the request as the scheduler does."""
    req.num_computed_tokens = req.num_cached_tokens = bm.allocate_prefix(req)
    return req.num_cached_tokens


def admit(bm: BlockManager, req) -> int:
    """Admission: prefix lookup, then slots for the rest of the known tokens."""
    cached = lookup(bm, req)
    compute(bm, req, req.num_tokens - req.num_computed_tokens)
    return cached


def ref_counts_match_tables(bm: BlockManager) -> bool:
    holders = Counter(b for table in bm.block_tables.values() for b in table)
    return all(bm.ref_counts[b] == holders[b] for b in range(bm.num_blocks))


# ---------------------------------------------------------------------- basics
def test_rejects_empty_pool():
    with pytest.raises(ValueError, match="num_blocks must be positive"):
        BlockManager(0, 16)


@pytest.mark.parametrize("num_tokens, expected", [(1, 1), (4, 1), (5, 2), (8, 2), (9, 3), (0, 0)])
def test_num_blocks_needed_is_ceil(num_tokens, expected):
    assert BlockManager(8, 4).num_blocks_needed(num_tokens) == expected


@pytest.mark.parametrize("prompt_len", [1, 3, 4, 5, 11, 12, 13])
def test_on_demand_allocation_holds_ceil_blocks(prompt_len):
    bm = BlockManager(16, 4)
    req = make_request(prompt_len)
    admit(bm, req)
    table = bm.get_block_table(req.req_id)
    assert len(table) == -(-prompt_len // 4)
    assert len(set(table)) == len(table)
    assert len(table) * 4 - prompt_len < 4  # waste below one block
    assert bm.num_free_blocks == 16 - len(table)


def test_blocks_grow_one_at_a_time_as_tokens_arrive():
    bm = BlockManager(16, 4)
    req = make_request(3)
    admit(bm, req)
    sizes = []
    for token in range(10, 20):
        req.append_output_token(token)
        compute(bm, req, 1)
        sizes.append(len(bm.get_block_table(req.req_id)))
    # 4..13 tokens computed: a new block exactly when the count crosses a multiple of 4.
    assert sizes == [1, 2, 2, 2, 2, 3, 3, 3, 3, 4]
    assert bm.usage == pytest.approx(4 / 16)


def test_allocation_is_all_or_nothing():
    bm = BlockManager(4, 4)
    a = make_request(9, req_id="a")
    admit(bm, a)  # 3 blocks
    b = make_request(8, req_id="b")
    lookup(bm, b)
    before = (list(bm.ref_counts), bm.num_free_blocks)
    assert bm.allocate_slots(b, 8) is False  # needs 2, only 1 free
    assert bm.get_block_table("b") == []
    assert (list(bm.ref_counts), bm.num_free_blocks) == before
    assert bm.allocate_slots(b, 5) is False  # still 2 blocks
    assert (list(bm.ref_counts), bm.num_free_blocks) == before
    assert bm.allocate_slots(b, 4) is True
    assert bm.num_free_blocks == 0


def test_free_returns_every_block_and_is_idempotent():
    bm = BlockManager(8, 4)
    reqs = [make_request(n) for n in (5, 9, 1)]
    for r in reqs:
        admit(bm, r)
    assert bm.num_free_blocks == 8 - (2 + 3 + 1)
    for r in reqs:
        bm.free(r)
    bm.free(reqs[0])
    assert bm.num_free_blocks == 8
    assert bm.ref_counts == [0] * 8
    assert bm.block_tables == {}
    assert bm.usage == 0.0


# ---------------------------------------------------------------------- prefix caching
def test_prefix_hit_on_shared_prefix_sets_computed_tokens():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    shared = [7, 8, 9, 10, 11, 12, 13, 14]
    a = make_request(shared + [1, 2, 3], req_id="a")
    assert admit(bm, a) == 0
    b = make_request(shared + [4, 5], req_id="b")
    assert lookup(bm, b) == 8
    assert bm.get_block_table("b") == bm.get_block_table("a")[:2]
    assert [bm.ref_counts[x] for x in bm.get_block_table("a")] == [2, 2, 1]
    assert (bm.prefix_queries, bm.prefix_hits) == (11 + 10, 8)
    # Only the rest is allocated, in a block of its own.
    compute(bm, b, 2)
    assert len(bm.get_block_table("b")) == 3
    assert bm.get_block_table("b")[2] not in bm.get_block_table("a")


def test_prefix_hit_never_covers_the_whole_prompt():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    prompt = list(range(1, 9))  # exactly two blocks
    admit(bm, make_request(prompt, req_id="a"))
    b = make_request(prompt, req_id="b")
    # One token must still be computed to get logits: only the first block is reused.
    assert lookup(bm, b) == 4
    c = make_request(prompt + [99], req_id="c")
    assert lookup(bm, c) == 8


def test_a_block_is_shared_from_its_allocation_and_unkeyed_if_its_writer_never_computes_it():
    """A block is keyed as it is allocated for the tokens that fill it: a request admitted after it in
    the same step reuses it (the forward writes it before anyone attends over it). A writer freed
    before computing it (preempted in the same step) takes the key with it."""
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    a = make_request(8, req_id="a")
    lookup(bm, a)
    assert bm.allocate_slots(a, 8)  # scheduled; the step has not run
    b = make_request(9, req_id="b")
    assert lookup(bm, b) == 8  # b reuses both blocks in the same step
    assert bm.get_block_table("b") == bm.get_block_table("a")
    bm.end_step()
    bm.free(a)  # computed by then: the blocks stay cached
    c = make_request(9, req_id="c")
    assert lookup(bm, c) == 8
    # A writer preempted before its step runs: nobody may reuse its blocks afterwards.
    bm2 = BlockManager(16, 4, enable_prefix_caching=True)
    w = make_request([7] * 8, req_id="w")
    lookup(bm2, w)
    assert bm2.allocate_slots(w, 8)
    bm2.free(w)
    late = make_request([7] * 9, req_id="late")
    assert lookup(bm2, late) == 0
    assert bm2.block_keys == [None] * 16


def test_freeing_a_tentative_block_someone_shares_is_refused():
    """The scheduler never preempts a writer after an admission of the same step; the block manager
    checks it rather than hand out KV that will never be written."""
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    a = make_request(8, req_id="a")
    lookup(bm, a)
    assert bm.allocate_slots(a, 8)
    b = make_request(9, req_id="b")
    assert lookup(bm, b) == 8
    with pytest.raises(AssertionError, match="another request shares it"):
        bm.free(a)


def test_prefix_caching_off_never_shares():
    bm = BlockManager(16, 4, enable_prefix_caching=False)
    admit(bm, make_request(9, req_id="a"))
    b = make_request(9, req_id="b")
    assert lookup(bm, b) == 0
    assert (bm.prefix_queries, bm.prefix_hits) == (0, 0)
    compute(bm, b, 9)
    assert not set(bm.get_block_table("a")) & set(bm.get_block_table("b"))


def test_same_block_tokens_after_different_prefixes_never_share():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    a = make_request([1, 2, 3, 4, 5, 6, 7, 8, 9], req_id="a")
    admit(bm, a)
    # Same second block, different first block: the second block's KV differs, no hit at all.
    b = make_request([9, 9, 9, 9, 5, 6, 7, 8, 9], req_id="b")
    assert lookup(bm, b) == 0
    compute(bm, b, 9)
    assert not set(bm.get_block_table("a")) & set(bm.get_block_table("b"))


def test_prefix_keys_are_exact_despite_hash_collisions():
    # hash(n) == hash(n + modulus) for ints in CPython: colliding hashes, different tokens.
    big = sys.hash_info.modulus
    assert hash((5, 6)) == hash((5 + big, 6 + big))
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    admit(bm, make_request([5, 6, 1], req_id="a"))
    b = make_request([5 + big, 6 + big, 1], req_id="b")
    assert lookup(bm, b) == 0
    c = make_request([5, 6, 2], req_id="c")
    assert lookup(bm, c) == 2


def test_freed_cached_blocks_count_as_free_and_are_reused_by_a_later_request():
    bm = BlockManager(4, 4, enable_prefix_caching=True)
    a = make_request(list(range(1, 11)), req_id="a")
    admit(bm, a)
    table_a = list(bm.get_block_table("a"))
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.usage == 0.0
    b = make_request(list(range(1, 13)), req_id="b")
    # Both full blocks, and a's partly filled last block (tokens 9 and 10), which b continues.
    assert lookup(bm, b) == 10
    assert bm.get_block_table("b") == table_a
    assert bm.num_free_blocks == 1


def test_a_freed_requests_partial_block_is_continued_and_copied_when_shared():
    """A freed request's last, partly filled block is found by requests continuing its tokens: one that
    writes while another holds it copies it first; the last holder writes in place."""
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a = make_request([1, 2, 3, 4, 5, 6], req_id="a")  # a full block, then 5 6 in a partial one
    admit(bm, a)
    full, partial = bm.get_block_table("a")
    bm.free(a)
    b = make_request([1, 2, 3, 4, 5, 6, 7], req_id="b")
    assert lookup(bm, b) == 6 and bm.get_block_table("b") == [full, partial]
    c = make_request([1, 2, 3, 4, 5, 6, 8], req_id="c")
    assert lookup(bm, c) == 6 and bm.get_block_table("c") == [full, partial]
    assert bm.ref_counts[partial] == 2
    assert bm.allocate_slots(b, 1)
    (copy,) = [blk for blk in bm.get_block_table("b") if blk not in (full, partial)]
    assert bm.get_block_table("b") == [full, copy] and bm.take_pending_copies() == [(partial, copy)]
    assert bm.allocate_slots(c, 1)  # now the only holder
    assert bm.get_block_table("c") == [full, partial] and bm.take_pending_copies() == []


def test_writing_in_place_drops_what_the_blocks_other_keys_said_of_those_slots():
    """b continues a's partial block and fills it (it gets a full key); c continues a's tokens
    differently in the same block: the full key must go, or d would read c's KV as b's."""
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    a = make_request([1, 2, 3, 4, 5, 6], req_id="a")
    admit(bm, a)
    bm.free(a)
    b = make_request([1, 2, 3, 4, 5, 6, 7, 8, 9], req_id="b")
    assert admit(bm, b) == 6  # fills the partial block with 7 8, and 9 in a new one
    bm.free(b)
    c = make_request([1, 2, 3, 4, 5, 6, 70, 80, 90], req_id="c")
    assert admit(bm, c) == 6  # 5 6 of b's full block [5 6 7 8]; c writes 70 80 over 7 8 in place
    d = make_request([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], req_id="d")
    assert lookup(bm, d) == 6  # the full block [5 6 7 8] is gone; 5 6 are still there (c holds them)


def _two_freed_requests():
    """Pool of 6 blocks of 2; a then b each computed 2 full blocks + 1 partial, then freed (a first)."""
    bm = BlockManager(6, 2, enable_prefix_caching=True)
    a = make_request([1, 1, 2, 2, 3], req_id="a")
    b = make_request([4, 4, 5, 5, 6], req_id="b")
    admit(bm, a)
    admit(bm, b)
    a_full, b_full = bm.get_block_table("a")[:2], bm.get_block_table("b")[:2]
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 6
    return bm, a_full, b_full


def _hits(bm: BlockManager, prompt: list[int], req_id: str) -> int:
    probe = make_request(prompt, req_id=req_id)
    hits = lookup(bm, probe)
    bm.free(probe)
    return hits


def _grab(bm: BlockManager, num_blocks: int) -> list[int]:
    req = make_request(2 * num_blocks, req_id="grab")
    lookup(bm, req)
    assert bm.allocate_slots(req, 2 * num_blocks)
    return bm.get_block_table("grab")


def test_lru_evicts_the_least_recently_freed_blocks_first():
    bm, a_full, b_full = _two_freed_requests()
    taken = _grab(bm, 4)  # a's three (its partial block too, freed before b's), then b's partial one
    assert set(a_full) <= set(taken) and not set(b_full) & set(taken)
    assert _hits(bm, [4, 4, 5, 5, 6], "pb") == 4
    assert _hits(bm, [1, 1, 2, 2, 3], "pa") == 0


def test_lru_evicts_a_requests_tail_before_its_prefix():
    bm, a_full, b_full = _two_freed_requests()
    taken = _grab(bm, 2)  # a's partial block, then its second full block
    assert a_full[1] in taken and a_full[0] not in taken
    assert _hits(bm, [1, 1, 2, 2, 3], "pa") == 2
    assert _hits(bm, [4, 4, 5, 5, 6], "pb") == 4


def test_lru_a_reused_prefix_becomes_most_recent():
    bm, a_full, b_full = _two_freed_requests()
    assert _hits(bm, [1, 1, 2, 2, 3], "pa") == 4  # a's blocks used again and freed after b's
    taken = _grab(bm, 4)
    assert set(b_full) <= set(taken) and not set(a_full) & set(taken)
    assert _hits(bm, [1, 1, 2, 2, 3], "pa2") == 4
    assert _hits(bm, [4, 4, 5, 5, 6], "pb") == 0


def test_touching_a_cached_block_protects_it_from_eviction():
    bm = BlockManager(3, 2, enable_prefix_caching=True)
    a = make_request([1, 2, 3, 4, 5], req_id="a")
    admit(bm, a)
    bm.free(a)
    b = make_request([1, 2, 9], req_id="b")
    assert lookup(bm, b) == 2  # revives a's first block (ref 1 again)
    shared = bm.get_block_table("b")[0]
    c = make_request([7, 7, 7, 7], req_id="c")
    assert lookup(bm, c) == 0
    assert bm.allocate_slots(c, 4)  # takes the other two blocks, never the one b holds
    assert shared not in bm.get_block_table("c")
    assert bm.ref_counts[shared] == 1
    assert bm.allocate_slots(b, 1) is False  # pool exhausted


# ---------------------------------------------------------------------- sharing and copy-on-write
def continued(bm: BlockManager, prompt: list[int], ids: list[str]) -> list:
    """Requests continuing a freed request's computed ``prompt``, each with one token of its own: they
    share its blocks, the partly filled last one too (``ids[0]`` is admitted first)."""
    base = make_request(prompt, req_id="base")
    admit(bm, base)
    bm.free(base)
    reqs = []
    for k, req_id in enumerate(ids):
        req = make_request(prompt + [40 + k], req_id=req_id)
        assert lookup(bm, req) == len(prompt)
        reqs.append(req)
    return reqs


def test_continuations_share_blocks_by_reference():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    reqs = continued(bm, list(range(1, 7)), ["p", "c0", "c1", "c2"])
    table = bm.get_block_table("p")
    assert all(bm.get_block_table(r.req_id) == table for r in reqs)
    assert bm.get_block_table("c0") is not table  # own list, shared blocks
    assert [bm.ref_counts[b] for b in table] == [4, 4]
    assert bm.num_free_blocks == 8 - 2
    for r in reqs:
        bm.free(r)
    assert bm.ref_counts == [0] * 8 and bm.num_free_blocks == 8


def test_copy_on_write_copies_a_shared_partial_block_exactly_once():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    parent, child = continued(bm, list(range(1, 7)), ["p", "c"])  # blocks [full, partial (2 of 4)]
    full, partial = bm.get_block_table("p")
    assert bm.allocate_slots(child, 1)
    new = bm.get_block_table("c")[1]
    assert new not in (full, partial)
    assert bm.get_block_table("c") == [full, new]
    assert bm.take_pending_copies() == [(partial, new)]
    assert bm.take_pending_copies() == []
    assert (bm.ref_counts[full], bm.ref_counts[partial], bm.ref_counts[new]) == (2, 1, 1)
    child.num_computed_tokens += 1
    # The parent is now the only holder of the partial block: it writes in place, no copy.
    assert bm.allocate_slots(parent, 1)
    assert bm.get_block_table("p") == [full, partial]
    assert bm.take_pending_copies() == []
    # Neither writes into a shared block again.
    child.append_output_token(42)
    assert bm.allocate_slots(child, 1)
    assert bm.take_pending_copies() == []


def test_no_copy_when_the_shared_last_block_is_full():
    bm = BlockManager(8, 4, enable_prefix_caching=True)
    _, child = continued(bm, list(range(1, 9)), ["p", "c"])
    assert bm.allocate_slots(child, 1)
    assert bm.take_pending_copies() == []
    assert bm.get_block_table("c")[:2] == bm.get_block_table("p")
    assert len(bm.get_block_table("c")) == 3


def test_copy_on_write_is_all_or_nothing():
    bm = BlockManager(2, 4, enable_prefix_caching=True)
    _, child = continued(bm, list(range(1, 7)), ["p", "c"])
    assert bm.allocate_slots(child, 1) is False
    assert bm.take_pending_copies() == []
    assert bm.get_block_table("c") == bm.get_block_table("p")


def test_freeing_a_copy_target_drops_its_pending_copy_and_keys_nothing():
    """Two families copy on write in the same step; the first child is then preempted, so its fresh
    block goes back to the pool and is handed to the second child. Only the live copy may run, and
    the block the dropped copy never filled is found by no later request."""
    bm = BlockManager(10, 4, enable_prefix_caching=True)
    p1, c1 = continued(bm, [1] * 6, ["p1", "c1"])
    base2 = make_request([2] * 6, req_id="base2")
    admit(bm, base2)
    bm.free(base2)
    p2, c2 = (make_request([2] * 6 + [t], req_id=r) for t, r in ((50, "p2"), (51, "c2")))
    assert lookup(bm, p2) == lookup(bm, c2) == 6
    assert bm.allocate_slots(c1, 1)
    dst1 = bm.get_block_table("c1")[1]
    bm.free(c1)  # preempted before its step ran
    assert bm.allocate_slots(c2, 1)
    dst2 = bm.get_block_table("c2")[1]
    assert dst2 == dst1  # the freed block is reused at once
    assert bm.take_pending_copies() == [(bm.get_block_table("p2")[1], dst2)]
    bm.end_step()
    again = make_request([1] * 6 + [41], req_id="again")
    assert lookup(bm, again) == 6 and bm.get_block_table("again")[1] != dst1


# ---------------------------------------------------------------------- properties
@st.composite
def block_ops(draw):
    op = st.tuples(
        st.sampled_from(["new", "grow", "cont", "cont", "free", "preempt", "step", "step"]),
        st.integers(0, 63),
        st.integers(1, 9),
    )
    kind = draw(st.sampled_from(["random", "families", "rounds"]))
    if kind == "random":
        ops = draw(st.lists(op, min_size=1, max_size=30))
    elif kind == "rounds":
        # Rounds of requests continuing freed ones (beam search above the core): each round's requests
        # find the last round's blocks, partly filled ones too, and the round is freed after a step.
        ops = [("new", draw(st.integers(0, 63)), draw(st.integers(1, 9))), ("step", 0, 1), ("free", 0, 1)]
        for _ in range(draw(st.integers(1, 5))):
            picks = draw(st.lists(st.tuples(st.integers(0, 63), st.integers(1, 3)), min_size=1, max_size=3))
            ops += [("cont", pick, n) for pick, n in picks] + [("step", 0, 1)]
            ops += [("free", 0, 1)] * len(picks)
    else:
        # Families sharing one freed request's blocks, its partly filled last one too, decoding together
        # in a pool that soon runs dry: the first to write into the shared block copies it.
        ops = []
        prompts = st.lists(st.tuples(st.integers(0, 63), st.integers(1, 9)), min_size=1, max_size=3)
        for pick, length in draw(prompts):
            ops += [("new", pick, length), ("step", 0, 1), ("free", 0, 1)]
        ops += [("cont", pick, 1) for pick in draw(st.lists(st.integers(0, 63), min_size=1, max_size=4))]
        ops += [("step", rotate, 1) for rotate in draw(st.lists(st.integers(0, 63), min_size=1, max_size=8))]
    # Mostly block sizes > 1: only those have partial blocks to copy on write.
    return draw(st.sampled_from([1, 2, 2, 4, 4])), draw(st.integers(2, 12)), draw(st.booleans()), ops


def _next_token(req) -> int:
    return 1 + zlib.crc32(f"{req.req_id}:{req.num_tokens}".encode()) % 3


# b continues a and fills a's partial block; c continues a differently in the same block; d continues
# b: d must not find b's block by its full key once c has written there.
_OVERWRITTEN_CONTINUATION = [("new", 0, 6), ("step", 0, 1), ("free", 0, 1)] + [
    op for pick, n in ((0, 3), (2, 2), (1, 1)) for op in (("cont", pick, n), ("step", 0, 1), ("free", 0, 1))
]


@settings(max_examples=500, deadline=None)
@given(block_ops())
@example((4, 12, True, _OVERWRITTEN_CONTINUATION))
def test_random_ops_keep_ref_counts_and_kv_consistent(case):
    """Random admissions (sharing prefixes, also blocks keyed earlier in the same step, and freed
    requests' partly filled blocks, copied on write), prefill chunks, frees (between steps, as
    finishes and aborts come) and preemptions (of the newest request, even one already given slots
    this step), in steps where every request decodes one token as in the scheduler, checked against a
    shadow KV cache: copies run first, then each request must read back exactly its own prefix before
    writing."""
    bs, num_blocks, caching, ops = case
    bm = BlockManager(num_blocks, bs, enable_prefix_caching=caching)
    kv: dict[int, tuple] = {}
    live: list = []
    planned: dict[str, tuple] = {}  # req_id -> (request, tokens given slots this step)
    freed: list[list[int]] = []  # the computed tokens of freed requests, for continuations

    def slot(req, p):
        return bm.block_tables[req.req_id][p // bs] * bs + p % bs

    def plan(req, n):
        while req.num_tokens < req.num_computed_tokens + n:
            req.append_output_token(_next_token(req))
        if bm.allocate_slots(req, n):
            planned[req.req_id] = (req, n)
            return True
        return False

    def preempt(victim):
        live.remove(victim)
        planned.pop(victim.req_id, None)  # its write never happens
        freed.append(victim.all_token_ids[: victim.num_computed_tokens])
        bm.free(victim)

    def newest():
        return max(live, key=lambda r: int(r.req_id[1:]))

    def step(rotate):
        # Every request not yet given slots decodes one token; when the pool is dry, the newest
        # request is preempted (possibly after its copy-on-write this step), as the scheduler does.
        # The running order need not be the arrival order (re-admitted requests run last): rotate it.
        k = rotate % len(live) if live else 0
        for req in live[k:] + live[:k]:
            if req not in live or req.req_id in planned:
                continue
            while not plan(req, 1):
                victim = newest()
                preempt(victim)
                if victim is req:
                    break
        copies = bm.take_pending_copies()
        bm.end_step()  # the step's allocations are final: the writes below compute them
        dsts = [d for _, d in copies]
        assert len(dsts) == len(set(dsts)), f"two copies into one block: {copies}"
        assert all(bm.ref_counts[d] > 0 for d in dsts), f"a copy into a free block: {copies}"
        # A copy only ever targets the partial block a request of this step is about to write into.
        targets = {
            bm.block_tables[r.req_id][r.num_computed_tokens // bs]
            for r, _ in planned.values()
            if r.num_computed_tokens % bs
        }
        assert set(dsts) <= targets, f"a stale copy: {copies}"
        moved = {(d * bs + o): kv.get(s * bs + o) for s, d in copies for o in range(bs)}
        for key, value in moved.items():
            kv[key] = value
        for req, n in planned.values():
            for p in range(req.num_computed_tokens):
                assert kv.get(slot(req, p)) == tuple(req.all_token_ids[: p + 1]), (req.req_id, p)
            for p in range(req.num_computed_tokens, req.num_computed_tokens + n):
                kv[slot(req, p)] = tuple(req.all_token_ids[: p + 1])
            req.num_computed_tokens += n
        planned.clear()

    def admit_new(tokens: list[int], req_id: str) -> None:
        req = make_request(tokens, req_id=req_id)
        lookup(bm, req)
        assert req.num_computed_tokens < req.num_tokens
        if plan(req, req.num_tokens - req.num_computed_tokens):
            live.append(req)
        else:
            bm.free(req)

    for i, (op, pick, n) in enumerate(ops):
        tokens = [1 + (pick >> k) % 2 for k in range(n)]
        if op == "cont" and freed:
            # A request continuing a freed one's tokens (a beam search's next round): it finds that
            # request's blocks, its last partly filled one too, and writes on from there.
            admit_new(freed[pick % len(freed)] + tokens, f"q{i}")
        elif op == "new" or not live:
            admit_new(tokens, f"q{i}")
        elif op == "step":
            step(pick)
        elif op == "preempt":
            preempt(newest())
        else:
            req = live[pick % len(live)]
            if op == "grow" and req.req_id not in planned:
                plan(req, n)
            elif op == "free" and req.req_id not in planned:  # finish or abort, between steps
                freed.append(req.all_token_ids[: req.num_computed_tokens])
                live.remove(req)
                planned.pop(req.req_id, None)
                bm.free(req)
        assert ref_counts_match_tables(bm)
        assert min(bm.ref_counts) >= 0
        assert bm.num_free_blocks == sum(1 for c in bm.ref_counts if c == 0)
        for req in live:  # on demand: exactly the blocks the computed + planned tokens need
            extra = planned[req.req_id][1] if req.req_id in planned else 0
            assert len(bm.block_tables[req.req_id]) == -(-(req.num_computed_tokens + extra) // bs)
    step(0)
    for req in list(live):
        bm.free(req)
    assert bm.num_free_blocks == num_blocks
    assert bm.ref_counts == [0] * num_blocks
    assert bm.block_tables == {} and bm.take_pending_copies() == []


# ---------------------------------------------------------------------- boundaries
def test_scheduler_block_manager_and_processors_import_no_torch():
    code = (
        "import sys\n"
        "import kvpilot.engine.scheduler, kvpilot.engine.block_manager, kvpilot.engine.request\n"
        "import kvpilot.engine.input_processor, kvpilot.engine.output_processor, kvpilot.engine.stats\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
