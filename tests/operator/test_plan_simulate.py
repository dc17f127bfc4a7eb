"""The plan simulator: the engine's own scheduler decisions, step for step, without a model.

The identity tests run a real ``LLMEngine`` (tiny random-weight checkpoint, a KV pool small enough to
preempt all the time) and the simulator over the same arrivals, and compare every ``schedule()``
call: the requests it ran, the tokens each fed, the requests it preempted. Arrivals are given in
forward steps: with a step time of exactly 1 s the simulator's clock counts forward steps, and the
engine loop below keeps the same count (idle gaps jump it, as the simulator's clock jumps).
"""

from __future__ import annotations

import dataclasses
import math
import random
import subprocess
import sys

import pytest

from kvpilot.operator.plan.simulate import (
    Arrival,
    EngineSettings,
    Sample,
    SimResult,
    SimulationError,
    StepTrace,
    prompt_tokens,
    quantile,
    simulate,
)


@dataclasses.dataclass(frozen=True)
class FixedStep:
    """Every step takes ``seconds``."""

    seconds: float = 1.0

    def step_seconds(self, num_batched_tokens: int, num_seqs: int, *shape: int) -> float:
        return self.seconds


def _arrivals(seed: int = 0, shared_prefixes: bool = False) -> list[Arrival]:
    """24 requests over the first ~60 steps, a burst at 0, then a second burst after an idle gap."""
    rng = random.Random(seed)
    arrivals = []
    for i in range(24):
        step = 0 if i < 8 else (rng.randint(1, 60) if i < 18 else 2000 + rng.randint(0, 5))
        prompt_len = rng.randint(4, 40)
        group = rng.randrange(2) if shared_prefixes and prompt_len > 17 else None
        arrivals.append(
            Arrival(
                float(step),
                prompt_len,
                rng.randint(8, 24),
                prefix_group=group,
                prefix_len=16 if group is not None else 0,
            )
        )
    return sorted(arrivals, key=lambda a: a.time)


def _engine_traces(engine, arrivals: list[Arrival], vocab_of: dict[int, int]) -> list[StepTrace]:
    """Run ``arrivals`` (times in forward steps) through a real engine; every schedule() decision."""
    from kvpilot.engine import SamplingParams

    traces: list[StepTrace] = []
    real_schedule = engine.scheduler.schedule

    def recording_schedule():
        out = real_schedule()
        if out.scheduled or out.preempted_req_ids:
            traces.append(StepTrace.of(out))
        return out

    engine.scheduler.schedule = recording_schedule
    clock = 0.0
    index = 0
    while index < len(arrivals) or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests() and arrivals[index].time > clock:
            clock = arrivals[index].time
        while index < len(arrivals) and arrivals[index].time <= clock:
            arrival = arrivals[index]
            prompt = [vocab_of[t] for t in prompt_tokens(index, arrival)]
            params = SamplingParams(max_tokens=arrival.output_len, ignore_eos=True, temperature=0.0)
            engine.add_request(f"r{index}", prompt, params)
            index += 1
        ran_before = engine.num_steps
        engine.step()
        clock += engine.num_steps - ran_before  # one second per forward step
    return traces


def _vocab_map(arrivals: list[Arrival]) -> dict[int, int]:
    """The simulator's synthetic token ids -> distinct ids inside the tiny model's vocabulary (the
    same sharing structure: equal ids stay equal, different ones stay different)."""
    tokens = sorted({t for i, a in enumerate(arrivals) for t in prompt_tokens(i, a)})
    assert len(tokens) < 1000
    return {t: 5 + i for i, t in enumerate(tokens)}


CASES = [
    pytest.param("recompute", False, False, id="recompute"),
    pytest.param("recompute", True, True, id="recompute-prefix-cache-shared-prefixes"),
    pytest.param("swap", False, False, id="swap"),
]


@pytest.mark.parametrize("mode,prefix_caching,shared", CASES)
def test_decisions_equal_the_real_engine_step_for_step(tiny_llama, mode, prefix_caching, shared) -> None:
    from kvpilot.engine import LLM

    arrivals = _arrivals(seed=2, shared_prefixes=shared)
    llm = LLM(
        str(tiny_llama),
        block_size=8,
        num_gpu_blocks_override=16,
        max_model_len=128,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        preemption_mode=mode,
        enable_prefix_caching=prefix_caching,
        # 3 CPU blocks of 2 KiB: some victims swap, others fall back to recompute.
        swap_space=3 * 2 * 2 * 8 * 2 * 16 * 4 / 2**30,
    )
    engine = llm.llm_engine
    expected = _engine_traces(engine, arrivals, _vocab_map(arrivals))
    stats = engine.stats()
    assert stats.num_preemptions_total > 0, "the pool is meant to preempt"
    if mode == "swap":
        assert engine.num_cpu_blocks == 3
        assert 0 < stats.num_swap_fallbacks < stats.num_preemptions_total, "both swaps and fallbacks"
    if shared:
        assert stats.prefix_cache_hits > 0

    settings = EngineSettings(
        num_gpu_blocks=16,
        block_size=8,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=128,
        enable_prefix_caching=prefix_caching,
        preemption_mode=mode,
        num_cpu_blocks=engine.num_cpu_blocks,
    )
    got: list[StepTrace] = []
    result = simulate(settings, arrivals, FixedStep(), on_step=got.append)
    for step, (g, e) in enumerate(zip(got, expected, strict=False)):
        assert g == e, f"step {step} differs"
    assert len(got) == len(expected)
    assert result.num_preemptions == stats.num_preemptions_total
    assert result.num_finished == len(arrivals)
    assert result.num_output_tokens == sum(a.output_len for a in arrivals)

    # The comparison can fail: an off-by-one output length changes the decisions.
    perturbed = [dataclasses.replace(a, output_len=a.output_len + 1) for a in arrivals]
    other: list[StepTrace] = []
    simulate(settings, perturbed, FixedStep(), on_step=other.append)
    assert other != expected


def test_metrics_on_a_hand_checked_run() -> None:
    """Two requests, ample KV, 1 s per step: every figure follows from the schedule by hand."""
    settings = EngineSettings(
        num_gpu_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128
    )
    # r0: 10-token prompt, 3 outputs; arrives at 0. r1: 20-token prompt, 2 outputs; arrives at 0.5.
    arrivals = [Arrival(0.0, 10, 3), Arrival(0.5, 20, 2)]
    traces: list[StepTrace] = []
    result = simulate(settings, arrivals, FixedStep(), on_step=traces.append)
    assert [t.scheduled for t in traces] == [
        (("r0", 10),),  # step 1 [0, 1): r0's prompt; r1 not there yet
        (("r0", 1), ("r1", 15)),  # step 2 [1, 2): r0 decodes, r1's first chunk within the budget of 16
        (("r0", 1), ("r1", 5)),  # step 3 [2, 3): r0's last token; r1's last chunk samples its first
        (("r1", 1),),  # step 4 [3, 4): r1's second and last token
    ]
    assert result.num_steps == 4 and result.num_preemptions == 0
    assert result.duration_s == 4.0
    assert result.num_finished == 2 and result.num_output_tokens == 5
    assert sorted(result.ttft_s) == [1.0, 2.5]  # r0 at 1 - 0; r1 at 3 - 0.5
    assert sorted(result.itl_s) == [1.0, 1.0, 1.0]
    assert result.output_tokens_per_s == 5 / 4
    assert [s.num_running for s in result.samples] == [1, 2, 1, 0]
    assert [p["time_s"] for p in result.timeline(2.0)] == [1.0, 2.0, 4.0]
    assert [p["time_s"] for p in result.timeline(10.0)] == [1.0, 4.0]  # the last step always
    assert [p["num_running"] for p in result.timeline(1.0)] == [1, 2, 1, 0]


def test_a_small_pool_preempts_and_a_larger_one_does_not() -> None:
    arrivals = [Arrival(0.1 * i, 30, 40) for i in range(20)]
    small = EngineSettings(
        num_gpu_blocks=24, block_size=8, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=256
    )
    large = dataclasses.replace(small, num_gpu_blocks=240)
    few_seqs = dataclasses.replace(small, max_num_seqs=2)
    step = FixedStep(0.01)
    tight, roomy, narrow = (simulate(s, arrivals, step) for s in (small, large, few_seqs))
    assert tight.num_preemptions > 0 and tight.preemptions_per_s > 0
    assert roomy.num_preemptions == 0 and narrow.num_preemptions == 0
    assert all(r.num_finished == 20 for r in (tight, roomy, narrow))
    assert max(s.kv_usage for s in tight.samples) == 1.0
    assert narrow.queue_depth(0.99) > roomy.queue_depth(0.99)  # two at a time: the rest queue


def test_max_sim_s_truncates() -> None:
    settings = EngineSettings(
        num_gpu_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128
    )
    result = simulate(settings, [Arrival(0.0, 10, 50)], FixedStep(), max_sim_s=5.0)
    assert result.truncated and result.num_finished == 0 and result.duration_s == 5.0


def test_refuses_what_the_engine_would_refuse() -> None:
    settings = EngineSettings(
        num_gpu_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128
    )
    with pytest.raises(SimulationError, match="does not fit the KV pool"):
        simulate(settings, [Arrival(0.0, 20, 5)], FixedStep())
    with pytest.raises(SimulationError, match="max_model_len"):
        simulate(dataclasses.replace(settings, num_gpu_blocks=64), [Arrival(0.0, 128, 5)], FixedStep())
    with pytest.raises(SimulationError, match="positive"):
        EngineSettings(0, 4, 4, 16, 128)
    with pytest.raises(SimulationError, match="prefix_len"):
        Arrival(0.0, 8, 2, prefix_group=0, prefix_len=8)
    with pytest.raises(SimulationError, match="must be positive"):
        simulate(dataclasses.replace(settings, num_gpu_blocks=64), [Arrival(0.0, 8, 2)], FixedStep(0.0))


def test_quantile_nearest_rank() -> None:
    assert quantile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0
    assert quantile([3.0, 1.0, 2.0, 4.0], 0.99) == 4.0
    assert math.isnan(quantile([], 0.5))


def test_simulate_module_imports_no_torch() -> None:
    code = (
        "import sys, kvpilot.operator.plan.simulate, kvpilot.operator.plan.step_time, "
        "kvpilot.operator.plan.workload, kvpilot.operator.plan.candidates; "
        "heavy = {'torch', 'transformers'} & set(sys.modules); assert not heavy, heavy; print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_max_preemption_rate_is_the_worst_window() -> None:
    def sample(t: float, preemptions: int) -> Sample:
        return Sample(t, 0.5, 0, 1, preemptions)

    # 1 preemption at 1 s, then 6 between 10 s and 14 s, then none.
    samples = [sample(1, 1), sample(5, 1), sample(10, 1), sample(12, 4), sample(14, 7), sample(30, 7)]
    result = SimResult(30.0, 6, 7, 1, 1, 10, tuple(samples), (), (), False)
    assert result.max_preemption_rate(5.0) == 6 / 5.0  # (10, 14]: from 1 to 7
    assert result.max_preemption_rate(100.0) == 7 / 100.0
    assert result.preemptions_per_s == 7 / 30.0


def test_max_in_flight_holds_arrivals_back_like_waiting_clients() -> None:
    settings = EngineSettings(
        num_gpu_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128
    )
    arrivals = [Arrival(0.0, 10, 5) for _ in range(10)]
    open_loop = simulate(settings, arrivals, FixedStep())
    capped = simulate(settings, arrivals, FixedStep(), max_in_flight=2)
    assert capped.num_finished == open_loop.num_finished == 10
    assert max(s.num_running + s.num_waiting for s in capped.samples) <= 2
    assert max(s.num_running + s.num_waiting for s in open_loop.samples) > 2
    # Latency counts from when a client sends: the held-back requests do not wait in the engine.
    assert max(capped.ttft_s) < max(open_loop.ttft_s)
    assert capped.duration_s > open_loop.duration_s  # two at a time instead of four


def test_a_clients_next_request_lands_a_turnaround_after_its_last_one_ended() -> None:
    """Two clients, 1 s steps. r0 (2 tokens) and r1 (5 tokens) start together; r0 ends with the step
    that ends at 2 s. Its client's next request, r2, reaches the engine at 2.5 s with a 0.5 s
    turnaround: inside the step r1 runs from 2 s to 3 s, so r2 waits for it and gets its first token
    at the end of the next one, 4 s (1.5 s after it was sent). Without a turnaround it is sent at 2 s
    and joins the step that starts there."""
    settings = EngineSettings(
        num_gpu_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128
    )
    arrivals = [Arrival(0.0, 8, 2), Arrival(0.0, 8, 5), Arrival(0.0, 8, 2)]
    turned = simulate(settings, arrivals, FixedStep(), max_in_flight=2, client_turnaround_s=0.5)
    at_once = simulate(settings, arrivals, FixedStep(), max_in_flight=2)
    assert sorted(turned.ttft_s) == [1.0, 1.0, 1.5]
    assert sorted(at_once.ttft_s) == [1.0, 1.0, 1.0]
    assert turned.num_finished == at_once.num_finished == 3
    assert max(s.num_running + s.num_waiting for s in turned.samples) <= 2
    with pytest.raises(SimulationError, match="client_turnaround_s"):
        simulate(settings, arrivals, FixedStep(), max_in_flight=2, client_turnaround_s=-1.0)


@dataclasses.dataclass(frozen=True)
class SlowAfter:
    """1 s a step, ``factor`` times that for a step that starts at or after ``at`` (a recorded slow
    stretch, as ``LinearStepTime.factor_at`` gives it)."""

    at: float
    factor: float

    def step_seconds(self, num_batched_tokens: int, num_seqs: int, *shape: int) -> float:
        return 1.0

    def factor_at(self, t: float) -> float:
        return self.factor if t >= self.at else 1.0


def test_a_step_takes_its_time_times_the_factor_where_it_starts() -> None:
    settings = EngineSettings(
        num_gpu_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128
    )
    # One request, 4 steps (its prompt, then 3 decodes) starting at 0, 1, 2 and 4.5: the third step
    # starts in the slow stretch (from 1.5 s, 2.5 times slower) and so does the fourth.
    result = simulate(settings, [Arrival(0.0, 10, 4)], SlowAfter(1.5, 2.5))
    assert [s.time for s in result.samples] == [1.0, 2.0, 4.5, 7.0]
    assert result.ttft_s == (1.0,) and result.itl_s == (1.0, 2.5, 2.5)


def test_a_model_that_spreads_its_steps_spreads_the_latencies_and_keeps_the_pace() -> None:
    """The same requests, 1 ms a step, as fixed and spread half at 0.5-1.0x and half at 1.0-1.5x: the
    spread gives requests different TTFTs where fixed steps gave one; the same seed draws the same
    run, another seed another; the total time stays close (the factors average 1)."""
    from kvpilot.operator.plan.step_time import LinearStepTime

    settings = EngineSettings(
        num_gpu_blocks=256, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128
    )
    arrivals = [Arrival(0.05 * k, 8, 20) for k in range(100)]
    fixed = LinearStepTime(0.001)
    spread = dataclasses.replace(fixed, jitter=((0.5, 0.5, 1.0), (1.0, 1.0, 1.5)), jitter_steps=1000)
    steady = simulate(settings, arrivals, fixed)
    a, b = simulate(settings, arrivals, spread, seed=1), simulate(settings, arrivals, spread, seed=1)
    other = simulate(settings, arrivals, spread, seed=2)
    assert max(steady.ttft_s) - min(steady.ttft_s) < 1e-9
    assert min(a.ttft_s) < 0.0006 and max(a.ttft_s) > 0.0014  # each request's one step, drawn
    assert a.ttft_s == b.ttft_s and a.samples == b.samples and a.ttft_s != other.ttft_s
    busy = sum(1 for _ in a.samples)
    assert busy == steady.num_steps == a.num_steps  # the same decisions, only their times differ
    assert sum(a.itl_s) == pytest.approx(sum(steady.itl_s), rel=0.05)
