"""Swap-mode preemption under memory pressure, prefix caching on, against transformers' greedy tokens."""

from __future__ import annotations

import pytest

from kvpilot.engine import LLM

from .hf_reference import BlockMoves, HFGreedy, generate_in_two_waves, shared_prefix_workload

BLOCK_SIZE = 8
# Bytes of one KV block of the tiny checkpoint (2 layers x K and V x 8 slots x 2 KV heads x 16 x fp32).
BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4


@pytest.fixture(scope="module")
def hf_greedy(tiny_llama):
    return HFGreedy(tiny_llama)


def test_swapped_sequences_generate_transformers_tokens(tiny_llama, hf_greedy):
    """16 device blocks (128 tokens) for 14 requests of up to 60 tokens: victims go to a 6-block CPU
    pool and come back; every sequence still generates exactly what transformers does alone."""
    llm = LLM(
        str(tiny_llama),
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=16,
        max_model_len=128,
        max_num_batched_tokens=64,
        preemption_mode="swap",
        swap_space=6 * BLOCK_BYTES / 2**30,
        enable_prefix_caching=True,
    )
    engine = llm.llm_engine
    assert engine.num_cpu_blocks == 6
    moves = BlockMoves(engine)
    group, others, max_tokens = shared_prefix_workload(engine.model_config.vocab_size, BLOCK_SIZE)
    prompts, tokens, cached = generate_in_two_waves(llm, group, others, max_tokens)

    stats = engine.stats()
    assert stats.num_preemptions_total > stats.num_swap_fallbacks, "some preemptions were swaps"
    assert moves.swapped_out > 0, "blocks were copied to the CPU pool"
    assert moves.swapped_in == moves.swapped_out, "every swapped block came back before its sequence ran"
    assert all(c >= 3 * BLOCK_SIZE for c in cached[1 : len(group)]), f"the shared prefix was a hit: {cached}"
    for i, (prompt, ours, n) in enumerate(zip(prompts, tokens, max_tokens, strict=True)):
        assert ours == hf_greedy(prompt, n), f"request {i} ({len(prompt)} prompt tokens)"
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.num_free_cpu_blocks == bm.num_cpu_blocks
