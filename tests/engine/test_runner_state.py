"""The step message as a change to the runner's state: what crosses once, what crosses every step.

The scheduler tests check the runner's copy against the scheduler every step (``FakeModel``); these
check what the messages carry, and that a runner out of step with the scheduler fails loudly."""

from __future__ import annotations

import pickle

import pytest

from kvpilot.engine.parallel.multiproc import _without_sampling_inputs
from kvpilot.engine.runner_state import CachedRequests
from kvpilot.engine.scheduler_output import ScheduledRequest, SchedulerOutput

from .conftest import FakeModel, make_request, make_scheduler


def _decode_messages(prompt_len: int, num_reqs: int = 8, steps: int = 6) -> list[SchedulerOutput]:
    """The step messages of ``num_reqs`` requests with ``prompt_len`` token prompts, prefill to decode."""
    sched = make_scheduler(
        num_blocks=1024, block_size=4, max_num_seqs=num_reqs, max_num_batched_tokens=8192, max_model_len=512
    )
    for i in range(num_reqs):
        sched.add_request(make_request(prompt_len, req_id=f"r{i}", max_tokens=steps + 4, ignore_eos=True))
    model = FakeModel(4)
    outs = []
    for _ in range(steps):
        out = sched.schedule()
        outs.append(out)
        sched.update_from_output(out, model.execute(sched, out))
    return outs


def _size(out: SchedulerOutput) -> int:
    return len(pickle.dumps(("execute", out), protocol=pickle.HIGHEST_PROTOCOL))


def test_a_decode_step_carries_one_token_and_one_block_per_request():
    outs = _decode_messages(prompt_len=64)
    first, decodes = outs[0], outs[1:]
    assert all(item.new is not None for item in first.scheduled)
    assert first.scheduled[0].new.prompt_token_ids == list(range(1, 65))
    for out in decodes:
        for item in out.scheduled:
            assert item.new is None and item.num_tokens == 1
            assert len(item.new_token_ids) == 1  # the previous step's sample
            assert len(item.new_block_ids) == 1 and item.block_ids_from == item.start_pos // 4


def test_decode_step_message_does_not_grow_with_the_prompt():
    short = _decode_messages(prompt_len=16)
    long = _decode_messages(prompt_len=256)
    # The first message carries the prompts; after it, a step costs the same whatever their length.
    assert _size(long[0]) > _size(short[0]) + 8 * 240
    for a, b in zip(short[1:], long[1:], strict=True):
        assert abs(_size(a) - _size(b)) <= 8 * 8, (_size(a), _size(b))  # block ids a few bytes longer


def test_a_preempted_request_is_forgotten_then_sent_again_whole():
    sched = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64)
    first = make_request(8, req_id="first", max_tokens=5, ignore_eos=True)
    victim = make_request(9, req_id="victim", max_tokens=4, ignore_eos=True)
    sched.add_request(first)
    sched.add_request(victim)
    model = FakeModel(4)
    seen = []
    while sched.requests:
        out = sched.schedule()
        seen.append(out)
        sched.update_from_output(out, model.execute(sched, out))
    preempted_at = next(i for i, o in enumerate(seen) if "victim" in o.preempted_req_ids)
    assert "victim" in seen[preempted_at].finished_req_ids
    back = next(item for o in seen[preempted_at + 1 :] for item in o.scheduled if item.req_id == "victim")
    assert back.new is not None and back.new.output_token_ids  # it had generated a token before
    # The last step's finished request is forgotten by one more message, which runs nothing.
    assert len(model.requests) == 1
    tail = sched.schedule()
    assert (
        not tail.is_empty and not tail.scheduled and tail.finished_req_ids == [seen[-1].scheduled[0].req_id]
    )
    model.execute(sched, tail)
    assert len(model.requests) == 0 and sched.schedule().is_empty


def test_runner_out_of_step_fails_loudly():
    runner = CachedRequests()
    unknown = ScheduledRequest("x", 4, 1, True, [7], 1, [3])
    with pytest.raises(RuntimeError, match="does not hold"):
        runner.update(SchedulerOutput([unknown], 1))
    outs = _decode_messages(prompt_len=8, num_reqs=1, steps=3)
    fresh = CachedRequests()
    fresh.update(outs[0])
    with pytest.raises(RuntimeError, match="holds"):
        fresh.update(outs[2])  # a message skipped: the tokens it feeds are not there


def test_ranks_that_do_not_sample_get_no_sampling_parameters():
    outs = _decode_messages(prompt_len=8, num_reqs=2, steps=2)
    slim = _without_sampling_inputs(outs[0])
    assert all(item.new.sampling_params is None for item in slim.scheduled)
    assert all(item.new.sampling_params is not None for item in outs[0].scheduled)  # not changed
    assert [i.new.prompt_token_ids for i in slim.scheduled] == [
        i.new.prompt_token_ids for i in outs[0].scheduled
    ]
    assert _without_sampling_inputs(outs[1]) is outs[1]  # nothing new: sent as it is
