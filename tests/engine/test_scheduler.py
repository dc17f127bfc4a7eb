"""Scheduler without a model: token budget, chunked prefill, FCFS admission, preemption, stopping."""

from __future__ import annotations

import weakref
import zlib

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvpilot.engine.errors import InvalidRequestError
from kvpilot.engine.input_processor import InputProcessor
from kvpilot.engine.outputs import ModelRunnerOutput
from kvpilot.engine.request import RequestStatus
from kvpilot.engine.sampling_params import SamplingParams

from .conftest import (
    EOS,
    VOCAB,
    FakeModel,
    check_blocks,
    check_step,
    make_request,
    make_requests,
    make_scheduler,
    run_to_completion,
    snapshot,
)

_models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def step(sched, model=None):
    """One checked engine step (with the scheduler's own fake model unless given one); returns
    (SchedulerOutput, updates)."""
    if model is None:
        model = _models.setdefault(sched, FakeModel(sched.block_manager.block_size))
    before = snapshot(sched)
    out = sched.schedule()
    check_step(sched, out, before)
    updates = sched.update_from_output(out, model.execute(sched, out))
    check_blocks(sched)
    return out, updates


def layout(out):
    """[(req_id, start_pos, num_tokens, do_sample)] of a step."""
    return [(i.req_id, i.start_pos, i.num_tokens, i.do_sample) for i in out.scheduled]


def scripted(tokens: dict[str, list[int]]):
    """A token function that replays ``tokens[req_id]`` (then 9s)."""

    def token_fn(req):
        seq = tokens.get(req.req_id, [])
        return seq[req.num_output_tokens] if req.num_output_tokens < len(seq) else 9

    return token_fn


# ---------------------------------------------------------- admission (the checks: test_input_processor)
def test_max_tokens_is_clipped_to_max_model_len():
    sched = make_scheduler(max_model_len=16)
    reqs = [make_request(15, max_tokens=8), make_request(10, max_tokens=None), make_request(4, max_tokens=5)]
    for r in reqs:
        sched.add_request(r)
    assert [r.max_output_tokens for r in reqs] == [1, 6, 5]
    run_to_completion(sched)
    assert [r.num_output_tokens for r in reqs] == [1, 6, 5]
    assert all(r.finish_reason == "length" and r.num_tokens <= 16 for r in reqs)


def test_a_request_that_needs_the_whole_pool_completes_alone():
    sched = make_scheduler(num_blocks=4, block_size=4, max_model_len=128)  # 16 slots
    # 10 prompt + 7 output: the last token is never fed back, so 16 slots suffice (the input
    # processor refuses one more output token).
    fits = make_request(10, req_id="fits", max_tokens=7, ignore_eos=True)
    sched.add_request(fits)
    run_to_completion(sched)
    assert fits.num_output_tokens == 7 and fits.finish_reason == "length"
    assert sched.block_manager.num_free_blocks == 4


@pytest.mark.parametrize("caching", [False, True])
def test_requests_at_the_pool_limit_complete_together_through_preemption(caching):
    # Each request alone needs the whole pool at its peak (4 + 13 - 1 = 16 slots).
    sched = make_scheduler(
        num_blocks=4, block_size=4, max_num_batched_tokens=16, enable_prefix_caching=caching
    )
    reqs = [make_request(4, req_id=f"r{i}", max_tokens=13, ignore_eos=True) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    run_to_completion(sched)
    assert sched.num_preemptions_total > 0
    assert [r.num_output_tokens for r in reqs] == [13, 13, 13]
    assert sched.block_manager.num_free_blocks == 4 and sched.block_manager.block_tables == {}


# ---------------------------------------------------------------------- budget and chunked prefill
def test_long_prompt_is_prefilled_in_chunks_across_steps():
    sched = make_scheduler(max_num_batched_tokens=16)
    req = make_request(40, req_id="long", max_tokens=2, ignore_eos=True)
    sched.add_request(req)
    steps = [layout(step(sched)[0]) for _ in range(4)]
    assert steps == [
        [("long", 0, 16, False)],
        [("long", 16, 16, False)],
        [("long", 32, 8, True)],
        [("long", 40, 1, True)],
    ]
    assert req.is_finished and req.num_output_tokens == 2


def test_token_budget_is_filled_and_never_exceeded():
    sched = make_scheduler(max_num_batched_tokens=16)
    reqs = make_requests([20, 20, 20], max_tokens=3, ignore_eos=True)
    for r in reqs:
        sched.add_request(r)
    outs = [step(sched)[0] for _ in range(4)]
    assert [o.num_batched_tokens for o in outs] == [16, 16, 16, 15]
    assert layout(outs[0]) == [("r0", 0, 16, False)]
    assert layout(outs[1]) == [("r0", 16, 4, True), ("r1", 0, 12, False)]
    assert layout(outs[2]) == [("r0", 20, 1, True), ("r1", 12, 8, True), ("r2", 0, 7, False)]
    assert layout(outs[3]) == [("r0", 21, 1, True), ("r1", 20, 1, True), ("r2", 7, 13, True)]
    assert reqs[0].is_finished and not reqs[1].is_finished


def test_decodes_are_scheduled_before_prefill_chunks():
    sched = make_scheduler(max_num_batched_tokens=8)
    dec = make_request(3, req_id="dec", max_tokens=8, ignore_eos=True)
    pre = make_request(30, req_id="pre", max_tokens=2, ignore_eos=True)
    sched.add_request(dec)
    sched.add_request(pre)
    assert layout(step(sched)[0]) == [("dec", 0, 3, True), ("pre", 0, 5, False)]
    # Even when the prefilling request comes first in the running list, the decode goes first.
    sched.running.reverse()
    assert layout(step(sched)[0]) == [("dec", 3, 1, True), ("pre", 5, 7, False)]
    sched.config.max_num_batched_tokens = 1
    assert layout(step(sched)[0]) == [("dec", 4, 1, True)]


def test_without_chunked_prefill_a_prompt_waits_for_a_budget_that_holds_it_whole():
    sched = make_scheduler(max_num_batched_tokens=10, enable_chunked_prefill=False)
    a = make_request(4, req_id="a", max_tokens=3, ignore_eos=True)
    b = make_request(10, req_id="b", max_tokens=1, ignore_eos=True)
    c = make_request(2, req_id="c", max_tokens=1, ignore_eos=True)
    for r in (a, b, c):
        sched.add_request(r)
    # b never fits the budget left beside a's tokens, and c may not jump ahead of it (FCFS).
    assert layout(step(sched)[0]) == [("a", 0, 4, True)]
    assert layout(step(sched)[0]) == [("a", 4, 1, True)]
    assert layout(step(sched)[0]) == [("a", 5, 1, True)]
    assert [r.req_id for r in sched.waiting] == ["b", "c"]
    assert layout(step(sched)[0]) == [("b", 0, 10, True)]
    assert layout(step(sched)[0]) == [("c", 0, 2, True)]


def test_max_num_seqs_limits_running_requests():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    reqs = make_requests([4] * 5, max_tokens=3, ignore_eos=True)
    for r in reqs:
        sched.add_request(r)
    first = [step(sched)[0] for _ in range(3)]
    assert [[i.req_id for i in o.scheduled] for o in first] == [["r0", "r1"]] * 3
    assert reqs[0].is_finished and reqs[1].is_finished and len(sched.waiting) == 3
    out, _ = step(sched)
    assert [i.req_id for i in out.scheduled] == ["r2", "r3"]
    assert [r.req_id for r in sched.running] == ["r2", "r3"]


def test_admission_is_first_come_first_served():
    # The head needs 3 blocks while only 2 are free: the small request behind it must wait too.
    sched = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64)
    hog = make_request(12, req_id="hog", max_tokens=2, ignore_eos=True)
    head = make_request(12, req_id="head", max_tokens=1, ignore_eos=True)
    small = make_request(2, req_id="small", max_tokens=1, ignore_eos=True)
    sched.add_request(hog)
    step(sched)
    sched.add_request(head)
    sched.add_request(small)
    out, _ = step(sched)
    assert layout(out) == [("hog", 12, 1, True)]
    assert [r.req_id for r in sched.waiting] == ["head", "small"]
    out, _ = step(sched)
    assert [i.req_id for i in out.scheduled] == ["head", "small"]


def test_first_admissions_follow_arrival_order():
    sched = make_scheduler(num_blocks=8, block_size=2, max_num_seqs=3, max_num_batched_tokens=6)
    reqs = make_requests([5, 1, 9, 3, 7, 2, 4], max_tokens=4, ignore_eos=True)
    for r in reqs:
        sched.add_request(r)
    order: list[str] = []
    model = FakeModel(2)
    while sched.requests:
        out, _ = step(sched, model)
        order += [i.req_id for i in out.scheduled if i.req_id not in order]
    assert order == [r.req_id for r in reqs]


# ---------------------------------------------------------------------- preemption
def test_preemption_requeues_the_newest_running_request_at_the_front():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    reqs = make_requests([4, 4, 4], max_tokens=8, ignore_eos=True)
    late = make_request(4, req_id="late", max_tokens=1)
    for r in reqs:
        sched.add_request(r)
    model = FakeModel(4)
    step(sched, model)  # three prefills, one block each
    sched.add_request(late)
    r2 = reqs[2]
    generated = list(r2.output_token_ids)
    out, _ = step(sched, model)  # every decode needs a new block; only one is free
    assert out.preempted_req_ids == ["r2"]
    assert layout(out) == [("r0", 4, 1, True), ("r1", 4, 1, True)]
    assert r2.status == RequestStatus.PREEMPTED and r2.num_computed_tokens == 0
    assert r2.num_preemptions == 1 and sched.num_preemptions_total == 1
    assert r2.output_token_ids == generated and r2.num_tokens == 5
    assert "r2" not in sched.block_manager.block_tables
    assert list(sched.waiting) == [r2, late]
    assert sched.stats().num_preemptions_total == 1
    sched.abort_requests(["late"])
    # It comes back first and re-prefills prompt + generated tokens.
    while "r2" not in [i.req_id for i in out.scheduled]:
        out, _ = step(sched, model)
    (item,) = [i for i in out.scheduled if i.req_id == "r2"]
    # The runner forgot it: it is sent again whole, with the token generated before the preemption.
    assert item.new is not None and item.new.output_token_ids == generated
    assert (item.start_pos, model.fed["r2"]) == (0, r2.all_token_ids[: item.num_tokens])
    assert item.num_tokens >= 5  # the prompt and the token generated before the preemption
    run_to_completion(sched, model)
    assert all(r.num_output_tokens == 8 for r in reqs)


def test_a_victim_already_scheduled_this_step_gives_its_tokens_back():
    sched = make_scheduler(num_blocks=3, block_size=4, max_num_batched_tokens=8)
    older = make_request(12, req_id="older", max_tokens=1, ignore_eos=True)
    newer = make_request(4, req_id="newer", max_tokens=4, ignore_eos=True)
    assert newer.arrival_seq > older.arrival_seq
    sched.add_request(newer)  # queued first, but the lower priority
    sched.add_request(older)
    model = FakeModel(4)
    assert layout(step(sched, model)[0]) == [("newer", 0, 4, True), ("older", 0, 4, False)]
    out, _ = step(sched, model)
    # newer's decode got the last block; older's chunk then needs two: newer is the newest, out it goes.
    assert out.preempted_req_ids == ["newer"]
    assert layout(out) == [("older", 4, 7, False)]
    assert out.num_batched_tokens == 7
    assert newer.status == RequestStatus.PREEMPTED and sched.waiting[0] is newer
    run_to_completion(sched, model)
    assert older.num_output_tokens == 1 and newer.num_output_tokens == 4


def test_a_request_preempts_itself_when_it_is_the_newest():
    sched = make_scheduler(num_blocks=3, block_size=2, max_num_batched_tokens=8)
    old = make_request(3, req_id="old", max_tokens=3, ignore_eos=True)
    new = make_request(2, req_id="new", max_tokens=3, ignore_eos=True)
    sched.add_request(old)
    sched.add_request(new)
    model = FakeModel(2)
    assert layout(step(sched, model)[0]) == [("old", 0, 3, True), ("new", 0, 2, True)]
    out, _ = step(sched, model)  # old writes into its partial block; new needs a block and is the newest
    assert out.preempted_req_ids == ["new"] and layout(out) == [("old", 3, 1, True)]
    assert sched.waiting[0] is new and new.num_computed_tokens == 0
    run_to_completion(sched, model)
    assert old.num_output_tokens == 3 and new.num_output_tokens == 3


def test_recompute_after_preemption_reuses_cached_prefix_blocks():
    sched = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64, enable_prefix_caching=True)
    first = make_request(8, req_id="first", max_tokens=5, ignore_eos=True)
    # A prompt of its own: the same one would share first's blocks from the first step.
    victim = make_request(list(range(20, 29)), req_id="victim", max_tokens=4, ignore_eos=True)
    sched.add_request(first)
    sched.add_request(victim)
    model = FakeModel(4)
    step(sched, model)  # 2 + 3 blocks: the pool is full
    out, _ = step(sched, model)
    assert out.preempted_req_ids == ["victim"]
    while "victim" not in [i.req_id for i in out.scheduled]:
        out, _ = step(sched, model)
    (item,) = [i for i in out.scheduled if i.req_id == "victim"]
    # Its two full blocks survived in the cache: only the partial block's tokens are recomputed.
    assert (item.start_pos, model.fed["victim"]) == (8, victim.all_token_ids[8:10])
    assert victim.num_cached_tokens == 8
    run_to_completion(sched, model)
    assert (first.num_output_tokens, victim.num_output_tokens) == (5, 4)


# ---------------------------------------------------------------------- prefix caching in the scheduler
def test_prefix_cache_hit_skips_the_cached_prefix():
    sched = make_scheduler(block_size=4, max_num_batched_tokens=64, enable_prefix_caching=True)
    shared = list(range(10, 22))  # 12 tokens = 3 blocks
    a = make_request(shared + [1], req_id="a", max_tokens=4)
    sched.add_request(a)
    model = FakeModel(4)
    step(sched, model)
    b = make_request(shared + [2, 3], req_id="b", max_tokens=2)
    same = make_request(shared, req_id="same", max_tokens=2)
    sched.add_request(b)
    sched.add_request(same)
    out, _ = step(sched, model)
    assert layout(out) == [("a", 13, 1, True), ("b", 12, 2, True), ("same", 8, 4, True)]
    assert (b.num_cached_tokens, same.num_cached_tokens) == (12, 8)
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (13 + 14 + 12, 20)
    table_a = sched.block_manager.get_block_table("a")
    assert sched.block_manager.get_block_table("b")[:3] == table_a[:3]
    run_to_completion(sched, model)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_a_request_admitted_after_another_in_the_same_step_shares_the_blocks_it_allocates():
    """The first request's full blocks are keyed as they are allocated: the second, admitted after it in
    the same step, reuses them and computes only its last partial block (FakeModel checks that it
    reads back exactly its own prefix, written earlier in the same step)."""
    sched = make_scheduler(block_size=4, enable_prefix_caching=True)
    reqs = [make_request(9, req_id=f"r{i}") for i in range(2)]
    for r in reqs:
        sched.add_request(r)
    out, _ = step(sched)
    assert layout(out) == [("r0", 0, 9, True), ("r1", 8, 1, True)]
    assert sched.stats().prefix_cache_hits == 8
    table0, table1 = (sched.block_manager.get_block_table(r.req_id) for r in reqs)
    assert table0[:2] == table1[:2] and table0[2] != table1[2]


def test_prefix_cache_counts_each_admission_once():
    # A request stuck at the head of the queue is looked up again every step; it must be counted once.
    sched = make_scheduler(
        num_blocks=4, block_size=4, max_num_batched_tokens=64, max_model_len=16, enable_prefix_caching=True
    )
    a = make_request(12, req_id="a", max_tokens=4, ignore_eos=True)
    # b shares a's first block but needs two more: it waits at the head of the queue while a runs.
    b = make_request([1, 2, 3, 4, *range(30, 38)], req_id="b", max_tokens=2, ignore_eos=True)
    sched.add_request(a)
    sched.add_request(b)
    steps_waiting = 0
    while b.scheduled_time is None:
        step(sched)
        steps_waiting += 1
    assert steps_waiting > 2  # looked up at every one of those steps
    run_to_completion(sched, _models[sched])
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (12 + 12, 4)
    assert b.num_cached_tokens == 4


# ---------------------------------------------------------------------- stopping
def run_scripted(script: dict[str, list[int]], **params):
    """Run the scripted requests to the end; returns them and, per request id, the stop reason its
    last core output carried."""
    sched = make_scheduler()
    reqs = [make_request(3, req_id=rid, **params) for rid in script]
    for r in reqs:
        sched.add_request(r)
    outputs = []
    run_to_completion(sched, FakeModel(4, token_fn=scripted(script)), outputs=outputs)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    last = {o.req_id: o for o in outputs}
    for r in reqs:  # the output that finished a request says why, as the request's own status does
        assert last[r.req_id].finish_reason == r.finish_reason
        assert [o.new_token_ids[0] for o in outputs if o.req_id == r.req_id] == r.output_token_ids
    return reqs, {rid: o.stop_reason for rid, o in last.items()}


def test_stops_on_eos():
    (req,), stop_reasons = run_scripted({"a": [5, 6, EOS, 7]}, max_tokens=10)
    assert req.output_token_ids == [5, 6, EOS]
    assert (req.status, req.finish_reason, stop_reasons["a"]) == (
        RequestStatus.FINISHED_STOPPED,
        "stop",
        None,
    )


def test_ignore_eos_runs_to_max_tokens():
    (req,), _ = run_scripted({"a": [5, EOS, EOS, 7, 8]}, max_tokens=4, ignore_eos=True)
    assert req.output_token_ids == [5, EOS, EOS, 7]
    assert req.finish_reason == "length"


def test_no_eos_id_means_no_eos_stop():
    sched = make_scheduler()
    req = make_request(3, eos_token_id=None, max_tokens=3)
    sched.add_request(req)
    run_to_completion(sched, FakeModel(4, token_fn=lambda r: EOS))
    assert req.output_token_ids == [EOS] * 3 and req.finish_reason == "length"


def test_stops_on_stop_token_ids():
    (req,), stop_reasons = run_scripted({"a": [5, 6, 7, 8]}, max_tokens=10, stop_token_ids=[7, 30])
    assert req.output_token_ids == [5, 6, 7]
    assert (req.finish_reason, stop_reasons["a"]) == ("stop", 7)


def test_min_tokens_defers_eos_and_stop_tokens():
    (a, b, c), stop_reasons = run_scripted(
        {"a": [EOS, EOS, EOS, EOS], "b": [7, 5, 7, 7], "c": [EOS, 5, 6, 8, 9]},
        max_tokens=5,
        min_tokens=3,
        stop_token_ids=[7],
    )
    assert a.output_token_ids == [EOS, EOS, EOS] and a.finish_reason == "stop"
    assert b.output_token_ids == [7, 5, 7] and stop_reasons["b"] == 7
    assert c.output_token_ids == [EOS, 5, 6, 8, 9] and c.finish_reason == "length"


def test_max_tokens_finishes_with_length_and_reports_updates():
    sched = make_scheduler()
    req = make_request(3, req_id="a", max_tokens=2, ignore_eos=True)
    sched.add_request(req)
    model = FakeModel(4, token_fn=scripted({"a": [11, 12]}))
    _, ups = step(sched, model)
    assert [(u.req_id, u.new_token_ids, u.finish_reason) for u in ups] == [("a", [11], None)]
    assert req.scheduled_time is not None and req.num_computed_tokens == 3
    _, ups = step(sched, model)
    assert [(u.req_id, u.new_token_ids, u.finish_reason) for u in ups] == [("a", [12], "length")]
    assert req.finish_reason == "length"
    assert not sched.requests and sched.running == []


def test_chunks_without_sampling_report_no_update():
    sched = make_scheduler(max_num_batched_tokens=4)
    sched.add_request(make_request(6, req_id="a"))
    out, ups = step(sched)
    assert layout(out) == [("a", 0, 4, False)] and ups == []
    assert sched.requests["a"].num_computed_tokens == 4


def test_update_appends_the_runner_output_tokens_and_logprobs():
    sched = make_scheduler()
    a, b = make_request(3, req_id="a", logprobs=1), make_request(3, req_id="b")
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    runner_out = ModelRunnerOutput(["b", "a"], [7, 5], [None, {5: -0.5, 6: -1.5}])
    ups = sched.update_from_output(out, runner_out)
    assert [(u.req_id, u.new_token_ids, u.new_logprobs) for u in ups] == [
        ("a", [5], [{5: -0.5, 6: -1.5}]),
        ("b", [7], None),
    ]
    assert (a.output_token_ids, b.output_token_ids) == ([5], [7])
    ups = sched.update_from_output(sched.schedule(), ModelRunnerOutput(["a", "b"], [6, 8], [{6: -0.1}, None]))
    assert [(u.req_id, u.new_token_ids, u.new_logprobs) for u in ups] == [
        ("a", [6], [{6: -0.1}]),
        ("b", [8], None),
    ]
    assert (a.output_token_ids, b.output_token_ids) == ([5, 6], [7, 8])
    # Values only: an output shares no list with the scheduler's request.
    assert ups[0].new_token_ids is not a.output_token_ids


# ---------------------------------------------------------------------- abort and finish
def test_abort_running_and_waiting_frees_blocks():
    sched = make_scheduler(max_num_seqs=1)
    run, wait = make_request(9, req_id="run"), make_request(5, req_id="wait")
    sched.add_request(run)
    sched.add_request(wait)
    step(sched)
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks - 3
    done = sched.abort_requests(["run", "wait", "unknown", "run"])
    assert done == [run, wait]
    assert run.finish_reason == wait.finish_reason == "abort"
    assert sched.running == [] and not sched.waiting and not sched.requests
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    assert sched.block_manager.block_tables == {}
    # The next step runs nothing but tells the runner to forget the request it held (not the waiting one).
    tail = sched.schedule()
    assert (tail.scheduled, tail.finished_req_ids, tail.has_block_ops) == ([], ["run"], False)
    assert sched.schedule().is_empty


def test_abort_while_the_step_runs_drops_its_result():
    sched = make_scheduler()
    a, b = make_request(4, req_id="a"), make_request(4, req_id="b")
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sampled = FakeModel(4).execute(sched, out)
    sched.abort_requests(["a"])
    ups = sched.update_from_output(out, sampled)
    assert [u.req_id for u in ups] == ["b"]
    assert a.output_token_ids == [] and a.num_computed_tokens == 0
    check_blocks(sched)


def test_finish_requests_from_outside_the_step():
    sched = make_scheduler()
    req = make_request(4, req_id="a", max_tokens=8)
    sched.add_request(req)
    step(sched)
    assert sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED) == [req]
    assert req.finish_reason == "stop" and not sched.requests
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks


def test_stats_snapshot():
    sched = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=1)
    for r in make_requests([9, 4]):
        sched.add_request(r)
    step(sched)
    s = sched.stats()
    assert (s.num_running, s.num_waiting, s.num_swapped, s.num_preemptions_total) == (1, 1, 0, 0)
    assert s.kv_cache_usage == pytest.approx(3 / 10)


# ---------------------------------------------------------------------- properties
FAMILIES = [[1 + (k * k + f) % 3 for k in range(40)] for f in range(3)]


def _token(req) -> int:
    """Fake model: deterministic in (request, position); EOS only for requests whose id ends in 'e'."""
    h = zlib.crc32(f"{req.req_id}:{req.num_tokens}".encode())
    if req.req_id.endswith("e") and h % 5 == 0:
        return EOS
    return 1 + h % (VOCAB - 1)


def _expected_output(req) -> list[int]:
    """What the request must produce whatever the schedule (preemption must not change it)."""
    probe = make_request(req.prompt_token_ids, req_id=req.req_id, max_tokens=1)
    out = []
    while len(out) < req.max_output_tokens:
        token = _token(probe)
        probe.append_output_token(token)
        out.append(token)
        if token == EOS and not req.sampling_params.ignore_eos:
            break
    return out


@st.composite
def workloads(draw):
    chunked = draw(st.booleans())
    max_model_len = draw(st.integers(6, 48))
    budget = draw(st.integers(1, 20))
    block_size = draw(st.sampled_from([1, 2, 4]))
    pool_tokens = draw(st.integers(12, 40))  # small enough that preemption is common
    config = dict(
        block_size=block_size,
        num_blocks=-(-pool_tokens // block_size),
        max_num_seqs=draw(st.integers(1, 6)),
        max_model_len=max_model_len,
        # Without chunked prefill the engine requires a budget of at least max_model_len.
        max_num_batched_tokens=budget if chunked else max(budget, max_model_len),
        enable_chunked_prefill=chunked,
    )
    requests = draw(
        st.lists(
            st.tuples(
                st.integers(0, 8),  # arrival step
                st.integers(0, 2),  # prompt family (shared prefixes)
                st.integers(1, 24),  # prompt length (a few are rejected: too long for the model or pool)
                st.integers(1, 12),  # max_tokens
                st.none() | st.integers(0, 25),  # abort this many steps after arrival
                st.booleans(),  # may stop on EOS
            ),
            min_size=2,
            max_size=12,
        )
    )
    return config, requests


def drive(
    config: dict, requests: list[tuple], caching: bool, mode: str = "recompute", cpu_blocks: int = 0
) -> None:
    """Run ``requests`` (arrival, family, prompt length, max_tokens, abort after, eos[, n]) through a
    scheduler and the fake model, checking every invariant at every step."""
    sched = make_scheduler(
        enable_prefix_caching=caching, preemption_mode=mode, num_cpu_blocks=cpu_blocks, **config
    )
    bm = sched.block_manager
    bs = bm.block_size
    model = FakeModel(bs, token_fn=_token)
    checker = InputProcessor(None, VOCAB, EOS, sched, active_request_ids=(), live_sequence_ids=())
    arrivals: dict[int, list] = {}
    for i, spec in enumerate(requests):
        arrivals.setdefault(spec[0], []).append((i, spec))
    accepted, aborts, first_seen, siblings = [], {}, [], set()
    finished_at: dict[str, int] = {}
    last_arrival = max(spec[0] for spec in requests)
    total = sum(spec[2] + spec[3] for spec in requests)
    bound = last_arrival + total * (len(requests) + 1) + 10
    for now in range(bound):
        for i, (_, fam, plen, max_tokens, abort_after, eos, *rest) in arrivals.get(now, []):
            n = rest[0] if rest else 1
            group = [
                make_request(
                    FAMILIES[fam][:plen],
                    req_id=f"q{i}" + (f"s{j}" if j else "") + ("e" if eos else ""),
                    max_tokens=max_tokens,
                    ignore_eos=not eos,
                )
                for j in range(n)
            ]
            peak = plen + min(max_tokens, config["max_model_len"] - plen) - 1
            fits = (
                plen < config["max_model_len"]
                and -(-peak // bs) <= config["num_blocks"]
                and n <= config["max_num_seqs"]
            )
            # The input processor (the one place requests are checked) agrees with this oracle.
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=not eos, n=n)
            if fits:
                checker.process(f"q{i}", FAMILIES[fam][:plen], params)
                for seq in group:  # n > 1: independent sequences, queued together
                    sched.add_request(seq)
                accepted += group
                siblings.update(r.req_id for r in group[1:])
                if abort_after is not None:
                    aborts.setdefault(now + abort_after, []).extend(r.req_id for r in group)
            else:
                with pytest.raises(InvalidRequestError):
                    checker.process(f"q{i}", FAMILIES[fam][:plen], params)
        for req in sched.abort_requests(aborts.pop(now, [])):
            finished_at[req.req_id] = now
        if now > last_arrival and not sched.requests:
            break
        before = snapshot(sched)
        running_before = list(sched.running)
        out = sched.schedule()
        check_step(sched, out, before)
        victims = [sched.requests[rid] for rid in out.preempted_req_ids]
        if victims:
            # Newest first: every victim is newer than every request left running; they lead the queue.
            assert all(v in running_before for v in victims)
            newest_left = max((r.arrival_seq for r in sched.running), default=-1)
            assert min(v.arrival_seq for v in victims) > newest_left
            swapped = [v for v in victims if v.status == RequestStatus.SWAPPED]
            recomputed = [v for v in victims if v.status != RequestStatus.SWAPPED]
            if mode == "recompute":
                assert not swapped
            assert list(sched.waiting)[: len(recomputed)] == recomputed[::-1]
            assert all(v.num_computed_tokens == 0 and v.req_id not in bm.block_tables for v in recomputed)
            assert list(sched.swapped)[: len(swapped)] == swapped[::-1]
            assert all(v.num_computed_tokens > 0 and v.req_id in bm.cpu_tables for v in swapped)
        first_seen += [i.req_id for i in out.scheduled if i.req_id not in first_seen]
        sampled = model.execute(sched, out)
        for upd in sched.update_from_output(out, sampled):
            if upd.finish_reason is not None:
                finished_at[upd.req_id] = now
        check_blocks(sched)
        stats = sched.stats()
        assert (stats.num_running, stats.num_waiting) == (len(sched.running), len(sched.waiting))
        assert stats.num_swapped == len(sched.swapped)
        assert stats.kv_cache_usage == pytest.approx(1 - bm.num_free_blocks / bm.num_blocks)
        assert 0 <= stats.prefix_cache_hits <= stats.prefix_cache_queries
        for req in sched.running:
            assert req.num_tokens <= config["max_model_len"]
    else:
        raise AssertionError(f"still unfinished after {bound} steps: {list(sched.requests)}")

    event(f"accepted {min(len(accepted), 4)}{'+' if len(accepted) >= 4 else ''}")
    event("preempted" if sched.num_preemptions_total else "no preemption")
    event("prefix hit" if bm.prefix_hits else "no prefix hit")
    event(f"steps {'<20' if now < 20 else '<100' if now < 100 else '>=100'}")
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.block_tables == {} and bm.ref_counts == [0] * bm.num_blocks
    assert bm.cpu_tables == {} and bm.num_free_cpu_blocks == bm.num_cpu_blocks
    assert not sched.running and not sched.waiting and not sched.swapped
    if mode == "swap":
        event("swapped" if sched.num_preemptions_total > sched.num_swap_fallbacks else "no swap")
    if siblings:
        event("n>1")
    # FCFS: requests, the sequences of an n > 1 request included, are first scheduled in arrival order.
    assert first_seen == [r.req_id for r in accepted if r.req_id in first_seen]
    for req in accepted:
        assert req.is_finished and req.req_id in finished_at
        if req.finish_reason == "abort":
            continue
        # Nothing lost or duplicated by chunking, preemption or prefix caching.
        assert req.output_token_ids == _expected_output(req)
        stopped_on_eos = req.output_token_ids[-1] == EOS and not req.sampling_params.ignore_eos
        assert req.finish_reason == ("stop" if stopped_on_eos else "length")
        assert req.num_tokens <= config["max_model_len"]


def request_specs(min_prompt_len=1, aborts=None, n=None, *, min_size: int, max_size: int):
    """Lists of ``drive`` request specs: arrival step 0-6, prompt family, prompt length up to 24,
    max_tokens up to 10, abort after (``aborts``, default never), may stop on EOS[, ``n``]."""
    fields = [st.integers(0, 6), st.integers(0, 2), st.integers(min_prompt_len, 24), st.integers(1, 10)]
    fields += [st.none() if aborts is None else aborts, st.booleans()] + ([] if n is None else [n])
    return st.lists(st.tuples(*fields), min_size=min_size, max_size=max_size)


@pytest.mark.parametrize("caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
@settings(max_examples=300, deadline=None)
@given(case=workloads())
def test_random_workloads_keep_every_invariant(caching, case):
    config, requests = case
    drive(config, requests, caching)


@pytest.mark.parametrize("caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
@settings(max_examples=100, deadline=None)
@given(requests=request_specs(min_size=4, max_size=10))
def test_tiny_pool_preempts_and_still_finishes_everything(caching, requests):
    config = dict(block_size=2, num_blocks=8, max_num_seqs=4, max_model_len=32, max_num_batched_tokens=8)
    drive(config, requests, caching)


@pytest.mark.parametrize("caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
@settings(max_examples=150, deadline=None)
@given(
    requests=request_specs(
        aborts=st.none() | st.integers(0, 20), n=st.integers(1, 3), min_size=3, max_size=9
    ),
    cpu_blocks=st.integers(0, 12),
)
def test_swap_mode_and_parallel_sampling_lose_nothing(caching, requests, cpu_blocks):
    """Swap preemption (with a CPU pool from empty to roomy, so both swap and its recompute fallback
    happen) and n > 1 groups that fork their prompt: the same invariants, outputs and final state."""
    config = dict(block_size=2, num_blocks=8, max_num_seqs=4, max_model_len=32, max_num_batched_tokens=8)
    drive(config, requests, caching, mode="swap", cpu_blocks=cpu_blocks)


@settings(max_examples=100, deadline=None)
@given(requests=request_specs(min_prompt_len=2, n=st.integers(2, 4), min_size=2, max_size=6))
def test_parallel_sampling_groups_with_recompute(requests):
    config = dict(block_size=4, num_blocks=12, max_num_seqs=6, max_model_len=40, max_num_batched_tokens=12)
    drive(config, requests, caching=True)


@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_a_queue_head_that_does_not_fit_leaves_the_pool_as_it_was(prefix_caching):
    """The head of the queue is asked again every step while the pool is full. Whether it is refused
    by a check before allocating (no prefix cache) or by allocating and undoing (prefix cache), nothing
    of the pool, its counters or the request changes, and it starts once room is freed."""
    sched = make_scheduler(
        num_blocks=6, block_size=4, max_num_batched_tokens=64, enable_prefix_caching=prefix_caching
    )
    big, waiting = make_request(20, max_tokens=4), make_request(10, max_tokens=2)
    sched.add_request(big)
    out = sched.schedule()
    assert [r.req_id for r in out.scheduled] == [big.req_id]  # 5 of the 6 blocks
    sched.add_request(waiting)
    bm = sched.block_manager
    before = (bm.num_free_blocks, bm.prefix_queries, bm.prefix_hits, dict(bm.block_tables))
    for _ in range(3):
        sched.update_from_output(out, _sampled(out))
        out = sched.schedule()
        assert waiting.req_id not in {r.req_id for r in out.scheduled}
        assert waiting.num_computed_tokens == waiting.num_cached_tokens == 0
        assert waiting.req_id not in bm.block_tables
        assert (bm.prefix_queries, bm.prefix_hits) == before[1:3]
    while big.req_id in sched.requests:
        sched.update_from_output(out, _sampled(out))
        out = sched.schedule()
    assert waiting.req_id in {r.req_id for r in out.scheduled}


def _sampled(out) -> ModelRunnerOutput:
    ids = [r.req_id for r in out.scheduled if r.do_sample]
    return ModelRunnerOutput(ids, [7] * len(ids), [None] * len(ids))
