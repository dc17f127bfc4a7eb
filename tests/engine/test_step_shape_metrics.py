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
