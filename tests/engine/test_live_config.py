"""Run-time settings (``live_config``): an update is validated whole against the start-up rules and
bounds, and a scheduler told a lower ``max_num_seqs`` preempts down to it in its next step, in the mode in
force, finishing every request with the tokens an undisturbed run gives."""

from __future__ import annotations

import pytest

from kvpilot.engine.errors import ConfigError
from kvpilot.engine.live_config import LiveConfig, LiveLimits, apply_update
from kvpilot.engine.request import RequestStatus

from .conftest import (
    FakeModel,
    check_blocks,
    check_step,
    make_requests,
    make_scheduler,
    run_to_completion,
    snapshot,
)

CURRENT = LiveConfig(
    max_num_seqs=8, max_num_batched_tokens=64, max_waiting_requests=None, preemption_mode="recompute"
)
LIMITS = LiveLimits(
    max_num_seqs=8,
    max_num_batched_tokens=64,
    max_model_len=128,
    enable_chunked_prefill=True,
    num_cpu_blocks=0,
)


def test_an_update_replaces_only_what_it_names() -> None:
    new = apply_update(CURRENT, {"max_num_seqs": 2, "max_waiting_requests": 0}, LIMITS)
    assert new == LiveConfig(2, 64, 0, "recompute")
    assert apply_update(new, {}, LIMITS) == new
    assert apply_update(new, {"max_waiting_requests": None}, LIMITS).max_waiting_requests is None


@pytest.mark.parametrize(
    ("update", "limits", "message"),
    [
        ({"max_num_batched_tokens": 32}, LiveLimits(8, 64, 128, False, 0), "without chunked prefill"),
        ({"preemption_mode": "swap"}, LIMITS, "needs the CPU swap pool"),
        ({"max_num_seqs": 9}, LIMITS, "above its start-up value 8"),
        ({"gpu_memory_utilization": 0.5}, LIMITS, "cannot change at run time"),
        ({"max_num_seqs": 1.5}, LIMITS, "max_num_seqs must be a positive integer"),
    ],
)
def test_an_update_outside_the_rules_is_refused_whole(update, limits, message) -> None:
    with pytest.raises(ConfigError, match=message):
        apply_update(CURRENT, update, limits)


def test_swap_is_allowed_where_the_cpu_pool_exists() -> None:
    limits = LiveLimits(8, 64, 128, True, num_cpu_blocks=16)
    assert apply_update(CURRENT, {"preemption_mode": "swap"}, limits).preemption_mode == "swap"


def _step(sched, model):
    before = snapshot(sched)
    out = sched.schedule()
    check_step(sched, out, before)
    sched.update_from_output(out, model.execute(sched, out))
    check_blocks(sched)
    return out


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_lowering_max_num_seqs_preempts_the_newest_down_to_the_bound_and_finishes_everything(mode) -> None:
    def run(lower_at: int | None):
        sched = make_scheduler(max_num_seqs=6, num_blocks=64, preemption_mode=mode, num_cpu_blocks=64)
        reqs = make_requests([5] * 6, max_tokens=12, ignore_eos=True)
        for r in reqs:
            sched.add_request(r)
        model = FakeModel(sched.block_manager.block_size)
        for i in range(4):
            out = _step(sched, model)
            if i == lower_at:
                assert len(sched.running) == 6
                sched.reconfigure(2, sched.config.max_num_batched_tokens, mode)
                out = _step(sched, model)
                assert sorted(out.preempted_req_ids) == ["r2", "r3", "r4", "r5"]  # the newest four
                assert [r.req_id for r in sched.running] == ["r0", "r1"]
                status = RequestStatus.SWAPPED if mode == "swap" else RequestStatus.PREEMPTED
                assert all(r.status == status for r in reqs[2:])
        run_to_completion(sched, model)
        assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
        return sched, [r.output_token_ids for r in reqs]

    lowered, tokens = run(lower_at=1)
    _, undisturbed = run(lower_at=None)
    assert tokens == undisturbed
    assert lowered.num_preemptions_total == 4
