"""The engine's step counters by phase and batch class (``kvpilot_engine_step*_total``): what the plan
fits its step time on. Checked against arithmetic over the requests a real engine ran, not against
the scheduler's own sums."""

from __future__ import annotations

import time

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine import metrics_names as names
from kvpilot.engine.scheduler_output import ScheduledRequest, SchedulerOutput


def _slice(start: int, n: int) -> ScheduledRequest:
    return ScheduledRequest(f"r{start}-{n}", start, n, True, [], 0, [])


def test_step_shape_of_a_scheduler_output() -> None:
    # Two decodes at positions 9 and 30, a fresh 5-token prompt chunk, and a chunk of 4 at position 8.
    out = SchedulerOutput([_slice(9, 1), _slice(30, 1), _slice(0, 5), _slice(8, 4)], 11)
    assert out.num_prefill_seqs == 2
    assert out.decode_context_tokens == 10 + 31
    # Causal pairs: 1+2+3+4+5 for the fresh chunk; 9+10+11+12 for the one after 8 computed tokens.
    assert out.prefill_attention_pairs == 15 + 42


def test_batch_classes() -> None:
    assert [names.batch_class(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [
        "1", "2", "3-4", "3-4", "5-8", "5-8", "9-16", "9-16", "17-32"
    ]  # fmt: skip
    assert names.batch_classes(16) == ("1", "2", "3-4", "5-8", "9-16")
    assert names.batch_classes(100)[-1] == "65-128"
    assert all(names.batch_class(n) in names.batch_classes(100) for n in range(1, 101))


def _series(registry) -> dict[tuple[str, str, str], float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if s.name in names.ENGINE_STEP_COUNTERS:
                out[(s.name, s.labels[names.LABEL_PHASE], s.labels[names.LABEL_NUM_SEQS])] = s.value
            elif s.name == names.ITERATION_TOKENS_TOTAL + "_count":
                out[("iterations", "", "")] = s.value
    return out


def _total(series, name: str, phase: str | None = None, batch: str | None = None) -> float:
    return sum(
        v
        for (n, p, b), v in series.items()
        if n == name and (phase is None or p == phase) and (batch is None or b == batch)
    )


@pytest.mark.parametrize("budget", [64, 256], ids=["chunked", "whole-prompts"])
def test_step_counters_add_up_to_what_the_requests_did(tiny_llama, budget) -> None:
    from kvpilot.engine import LLM, SamplingParams
    from kvpilot.engine.metrics import PrometheusStatLogger

    llm = LLM(
        str(tiny_llama),
        block_size=8,
        num_gpu_blocks_override=64,
        max_model_len=256,
        max_num_batched_tokens=budget,
        max_num_seqs=8,
        enable_prefix_caching=False,
    )
    engine = llm.llm_engine
    logger = PrometheusStatLogger.from_engine(engine, "m")
    engine.stat_loggers.append(logger)
    # One request at a time: every step runs one sequence. 100 tokens under a budget of 64 are
    # prefilled in two chunks (64, 36); no chunk is a single token (which would cost as a decode).
    requests = [(40, 5), (10, 3), (100, 4), (7, 1)]
    began = time.perf_counter()
    for prompt_len, max_tokens in requests:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
        llm.generate([{"prompt_token_ids": [5 + i % 50 for i in range(prompt_len)]}], params, use_tqdm=False)
    elapsed = time.perf_counter() - began
    series = _series(logger.registry)

    chunks = sum(-(-p // budget) for p, _ in requests)
    decodes = sum(g - 1 for _, g in requests)
    assert _total(series, names.ENGINE_STEPS_TOTAL, names.PHASE_PREFILL, "1") == chunks
    assert _total(series, names.ENGINE_STEPS_TOTAL, names.PHASE_DECODE, "1") == decodes
    assert _total(series, names.ENGINE_STEPS_TOTAL) == series[("iterations", "", "")] == chunks + decodes
    assert _total(series, names.ENGINE_STEP_TOKENS_TOTAL) == sum(p + g - 1 for p, g in requests)
    assert _total(series, names.ENGINE_STEP_SEQS_TOTAL) == chunks + decodes
    # A prompt of L tokens attends over 1 + 2 + ... + L pairs however it is chunked.
    assert _total(series, names.ENGINE_STEP_PREFILL_PAIRS_TOTAL) == sum(p * (p + 1) // 2 for p, _ in requests)
    assert _total(series, names.ENGINE_STEP_PREFILL_PAIRS_TOTAL, names.PHASE_DECODE) == 0
    # The decode at position q reads q + 1 positions; a request's decodes sit at L .. L + G - 2.
    context = sum(q + 1 for p, g in requests for q in range(p, p + g - 1))
    assert _total(series, names.ENGINE_STEP_DECODE_CONTEXT_TOTAL) == context
    seconds = _total(series, names.ENGINE_STEP_SECONDS_TOTAL)
    assert 0 < seconds <= elapsed
    # Batches of more than one sequence never ran, and every class up to max_num_seqs is exported.
    assert _total(series, names.ENGINE_STEPS_TOTAL, batch="2") == 0
    assert {b for (n, _, b) in series if n == names.ENGINE_STEPS_TOTAL} == set(names.batch_classes(8))


def test_batched_steps_count_in_their_class(tiny_llama) -> None:
    from kvpilot.engine import LLM, SamplingParams
    from kvpilot.engine.metrics import PrometheusStatLogger

    llm = LLM(str(tiny_llama), block_size=8, num_gpu_blocks_override=64, max_model_len=128, max_num_seqs=8)
    engine = llm.llm_engine
    logger = PrometheusStatLogger.from_engine(engine, "m")
    engine.stat_loggers.append(logger)
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0)
    # Three prompts admitted together: one prefill step of 3 sequences, then 5 decode steps of 3.
    llm.generate([{"prompt_token_ids": [7 + i] * 9} for i in range(3)], params, use_tqdm=False)
    series = _series(logger.registry)
    assert _total(series, names.ENGINE_STEPS_TOTAL, names.PHASE_PREFILL, "3-4") == 1
    assert _total(series, names.ENGINE_STEPS_TOTAL, names.PHASE_DECODE, "3-4") == 5
    assert _total(series, names.ENGINE_STEP_SEQS_TOTAL, names.PHASE_DECODE, "3-4") == 15
    assert _total(series, names.ENGINE_STEP_DECODE_CONTEXT_TOTAL, names.PHASE_DECODE) == 3 * sum(
        q + 1 for q in range(9, 14)
    )


def test_step_seconds_hold_the_whole_cycle_the_loggers_included(tiny_llama) -> None:
    """A running sequence waits for everything between two of its steps, the stat loggers' own time
    too: the steps' wall seconds must hold it, or a planner fitted on them runs the engine faster than
    it is."""
    from kvpilot.engine import LLM, SamplingParams
    from kvpilot.engine.metrics import PrometheusStatLogger
    from kvpilot.engine.stats import StatLoggerBase

    pause = 0.004

    class SlowLogger(StatLoggerBase):
        def record(self, scheduler_stats, iteration_stats) -> None:
            time.sleep(pause)

    llm = LLM(str(tiny_llama), block_size=8, num_gpu_blocks_override=64, max_model_len=128, max_num_seqs=8)
    engine = llm.llm_engine
    logger = PrometheusStatLogger.from_engine(engine, "m")
    engine.stat_loggers += [logger, SlowLogger()]
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0)
    began = time.perf_counter()
    llm.generate([{"prompt_token_ids": [9] * 12}], params, use_tqdm=False)
    elapsed = time.perf_counter() - began
    series = _series(logger.registry)
    steps = _total(series, names.ENGINE_STEPS_TOTAL)
    seconds = _total(series, names.ENGINE_STEP_SECONDS_TOTAL)
    assert steps == 24
    # Every step but the first starts when the one before it ended, its loggers' pause included.
    assert (steps - 1) * pause <= seconds <= elapsed


def test_attention_shape_of_decodes_and_chunks_at_several_positions() -> None:
    out = SchedulerOutput([_slice(3, 1), _slice(0, 7), _slice(12, 2), _slice(40, 1)], 11)
    assert (
        out.attention_shape() == (out.decode_context_tokens, out.prefill_attention_pairs) == (4 + 41, 28 + 27)
    )


def _step(num_seqs: int, wall_s: float, prefill: bool = False, context: int = 0):
    from kvpilot.engine.stats import IterationStats

    return IterationStats(
        num_batched_tokens=num_seqs * (16 if prefill else 1),
        num_prefill_tokens=num_seqs * 16 if prefill else 0,
        num_prompt_tokens=0,
        num_generation_tokens=num_seqs,
        num_running_seqs=num_seqs,
        num_preemptions=0,
        schedule_s=0.0,
        prepare_s=0.0,
        forward_s=0.0,
        sample_s=0.0,
        update_s=0.0,
        num_prefill_seqs=num_seqs if prefill else 0,
        wall_s=wall_s,
        decode_context_tokens=0 if prefill else context,
    )


def test_the_step_time_ratio_is_each_decode_step_over_the_earlier_mean_of_its_batch_size() -> None:
    """After the warm-up, a decode step of 2 ms where its batch size averaged 1 ms observes 2.0; the
    mean is per batch size (4 sequences at 4 ms each is 1.0), and prefill steps observe nothing."""
    from prometheus_client import CollectorRegistry

    from kvpilot.engine.step_metrics import StepShapeCounters

    registry = CollectorRegistry()
    counters = StepShapeCounters(registry, ("0", "m"), 8)
    warmup = names.STEP_TIME_RATIO_WARMUP
    for _ in range(warmup):
        counters.record(_step(1, 0.001))
        counters.record(_step(4, 0.004))
        counters.record(_step(1, 0.050, prefill=True))

    def ratio_samples() -> dict[str, float]:
        return {
            (s.name.removeprefix(names.ENGINE_STEP_TIME_RATIO), s.labels.get("le")): s.value
            for family in text_string_to_metric_families(generate_latest(registry).decode())
            for s in family.samples
            if s.name.startswith(names.ENGINE_STEP_TIME_RATIO)
        }

    assert ratio_samples()[("_count", None)] == 0  # exported from the start, nothing observed yet
    counters.record(_step(1, 0.002))
    counters.record(_step(4, 0.004))
    counters.record(_step(2, 0.003))  # a batch size with no history: no ratio yet
    counters.record(_step(1, 0.030, prefill=True))
    samples = ratio_samples()
    assert samples[("_count", None)] == 2
    assert samples[("_sum", None)] == pytest.approx(2.0 + 1.0)
    assert samples[("_bucket", "1.0")] == 1 and samples[("_bucket", "1.75")] == 1
    assert samples[("_bucket", "2.0")] == 2
    # The 2 ms step joined its mean: (32 x 1 + 2) / 33 ms.
    counters.record(_step(1, 0.001))
    assert ratio_samples()[("_sum", None)] == pytest.approx(3.0 + 1.0 / (34 / 33))


def test_the_step_time_ratio_baseline_knows_the_context() -> None:
    """Decode steps of one batch size over 300 and over 800 context positions differ by their shape:
    each is measured against the mean of its own context class, so a steady 1 ms at 300 and 2 ms at 800
    observe 1.0 both (a batch-size mean would read 0.67 and 1.33: a spread the plan's step-time model
    already prices through its cost per context token). A class spans a factor of 2 ** (1/4)."""
    from prometheus_client import CollectorRegistry

    from kvpilot.engine.step_metrics import StepShapeCounters, context_class

    assert context_class(310) == context_class(350) != context_class(300)  # [304, 362) is one class
    assert context_class(300) != context_class(800)
    assert context_class(0) == 0 < context_class(1)
    registry = CollectorRegistry()
    counters = StepShapeCounters(registry, ("0", "m"), 8)
    for _ in range(names.STEP_TIME_RATIO_WARMUP + 10):
        counters.record(_step(2, 0.001, context=300))
        counters.record(_step(2, 0.002, context=800))
    samples = {
        (s.name.removeprefix(names.ENGINE_STEP_TIME_RATIO), s.labels.get("le")): s.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for s in family.samples
        if s.name.startswith(names.ENGINE_STEP_TIME_RATIO)
    }
    assert samples[("_count", None)] == 20
    assert samples[("_sum", None)] == pytest.approx(20.0)
    assert samples[("_bucket", "0.95")] == 0 and samples[("_bucket", "1.0")] == 20


def test_arrival_gaps_of_the_requests_an_engine_queued(tiny_llama) -> None:
    """Requests queued with arrival stamps 0, 0.3 ms, 0.3 ms (a second prompt of the same call), then
    0.2 s and one stamped before it (a request the server stamped earlier but queued later): the gaps
    are 0.3 ms, 0, 0.1997 s and 0 -- each from the latest stamp before it, never negative."""
    from kvpilot.engine import LLM, SamplingParams
    from kvpilot.engine.metrics import PrometheusStatLogger

    engine = LLM(str(tiny_llama), block_size=8, num_gpu_blocks_override=64, max_model_len=128).llm_engine
    logger = PrometheusStatLogger.from_engine(engine, "m")
    engine.stat_loggers.append(logger)
    base = time.monotonic()
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for i, offset in enumerate((0.0, 0.0003, 0.0003, 0.2, 0.1)):
        engine.add_request(f"r{i}", [5, 6, 7], params, arrival_time=base + offset)
    while engine.has_unfinished_requests():
        engine.step()
    samples = {
        (s.name.removeprefix(names.ENGINE_ARRIVAL_GAP_SECONDS), s.labels.get("le")): s.value
        for family in text_string_to_metric_families(generate_latest(logger.registry).decode())
        for s in family.samples
        if s.name.startswith(names.ENGINE_ARRIVAL_GAP_SECONDS)
    }
    assert samples[("_count", None)] == 4
    assert samples[("_sum", None)] == pytest.approx(0.2, abs=1e-6)
    assert samples[("_bucket", "5e-05")] == 2  # the two zeros
    assert samples[("_bucket", "0.0003")] == 3 and samples[("_bucket", "0.25")] == 4
