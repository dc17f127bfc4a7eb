"""Tensor and pipeline parallelism on gloo, prefix caching on and swap-mode preemption, against
transformers' greedy tokens (not only against the engine's own one-process run)."""

from __future__ import annotations

import multiprocessing

import pytest

from kvpilot.engine import LLM

from .hf_reference import BlockMoves, HFGreedy, generate_in_two_waves, shared_prefix_workload

BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def hf_greedy(tiny_llama):
    return HFGreedy(tiny_llama)


@pytest.fixture(scope="module", autouse=True)
def no_worker_left_behind():
    yield
    left = [p for p in multiprocessing.active_children() if p.name.startswith("kvpilot-rank")]
    assert not left, f"worker processes left running: {left}"


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_parallel_greedy_with_prefix_cache_and_swaps_matches_transformers(tiny_llama, hf_greedy, tp, pp):
    # Per rank, one KV block holds (2 layers / pp) x K and V x 8 slots x (2 KV heads / tp) x 16 x fp32.
    block_bytes = (2 // pp) * 2 * BLOCK_SIZE * (2 // tp) * 16 * 4
    with LLM(
        str(tiny_llama),
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=16,
        max_model_len=128,
        max_num_batched_tokens=64,
        preemption_mode="swap",
        swap_space=6 * block_bytes / 2**30,
        enable_prefix_caching=True,
    ) as llm:
        engine = llm.llm_engine
        assert len(engine.executor.worker_pids) == tp * pp - 1
        assert engine.num_cpu_blocks == 6
        moves = BlockMoves(engine)
        group, others, max_tokens = shared_prefix_workload(engine.model_config.vocab_size, BLOCK_SIZE)
        prompts, tokens, cached = generate_in_two_waves(llm, group, others, max_tokens)
        stats = engine.stats()
    assert stats.prefix_cache_hits >= 3 * BLOCK_SIZE * (len(group) - 1)
    assert all(c >= 3 * BLOCK_SIZE for c in cached[1 : len(group)]), f"the shared prefix was a hit: {cached}"
    assert stats.num_preemptions_total > stats.num_swap_fallbacks, "some preemptions were swaps"
    assert moves.swapped_out > 0 and moves.swapped_in == moves.swapped_out
    for i, (prompt, ours, n) in enumerate(zip(prompts, tokens, max_tokens, strict=True)):
        assert ours == hf_greedy(prompt, n), f"request {i} ({len(prompt)} prompt tokens)"
