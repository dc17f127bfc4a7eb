"""The plan sizes a candidate's KV pool as kvpilot's engine does: from the ``kvpilot_kv_pool_info`` an
engine exports at one memory fraction, ``KVPool.blocks_at`` gives the block count engines started at
other fractions really have (real engines on CPU, where the fraction is of ``cpuMemoryBudgetBytes``)."""

from __future__ import annotations

from prometheus_client import generate_latest

from kvpilot.engine import LLM
from kvpilot.engine.metrics import PrometheusStatLogger
from kvpilot.operator.plan.pool import pool_of
from kvpilot.operator.plan.recording import parse_plan_scrape
from kvpilot.operator.remediation.replay import Record

BUDGET = 128 << 20


def _engine_scrape(model: str, fraction: float, **extra) -> tuple[str, int]:
    llm = LLM(
        model,
        device="cpu",
        cpu_memory_budget_bytes=BUDGET,
        gpu_memory_utilization=fraction,
        max_num_batched_tokens=extra.pop("max_num_batched_tokens_", 512),
        **extra,
    )
    try:
        logger = PrometheusStatLogger.from_engine(llm.llm_engine, "m")
        text = generate_latest(logger.registry).decode()
        return text, llm.llm_engine.kv_plan.num_blocks
    finally:
        llm.shutdown()


def test_blocks_at_another_fraction_are_the_engines_own(tiny_llama):
    text, blocks = _engine_scrape(str(tiny_llama), 0.5)
    pool = pool_of([parse_plan_scrape(Record(time=1.0, pod="p", tick=1.0, metrics=text))])
    assert pool.sizing is not None and pool.sizing.budget_bytes == BUDGET
    assert pool.num_gpu_blocks == blocks and pool.blocks_at(0.5) == blocks
    for fraction in (0.6, 0.8):
        _, real = _engine_scrape(str(tiny_llama), fraction)
        assert pool.blocks_at(fraction, 256, 512) == real, fraction
        # Scaling the count by the fraction (all a vLLM recording allows) underestimates it.
        assert blocks * fraction / 0.5 < real
    # The activation peak scales with the step shape: fewer batched tokens or sequences leave room.
    _, real = _engine_scrape(str(tiny_llama), 0.5, max_num_seqs=4, max_num_batched_tokens_=256)
    assert pool.blocks_at(0.5, 4, 256) == real > blocks


def test_an_explicitly_sized_pool_exports_no_sizing_and_does_not_move(tiny_llama):
    text, blocks = _engine_scrape(str(tiny_llama), 0.5, num_gpu_blocks_override=40)
    pool = pool_of([parse_plan_scrape(Record(time=1.0, pod="p", tick=1.0, metrics=text))])
    assert blocks == 40 and pool.sizing is None and pool.explicit_size
    assert pool.blocks_at(0.9) == 40
