"""Memory pressure on the real model: preemption (recompute and swap), prefix caching, n > 1 sharing."""

from __future__ import annotations

import random

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.stats import StatLoggerBase


def _workload(vocab: int, n: int = 24, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(4, 40))] for _ in range(n)]


class _Recorder(StatLoggerBase):
    """Stat logger keeping the per-step statistics."""

    def __init__(self) -> None:
        self.sched = []
        self.iters = []

    def record(self, sched, it) -> None:
        if it is not None:
            self.sched.append(sched)
            self.iters.append(it)


def _run(llm: LLM, prompts, params) -> tuple[list[list[int]], _Recorder]:
    rec = _Recorder()
    llm.llm_engine.stat_loggers.append(rec)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm.llm_engine.stat_loggers.remove(rec)
    return [o.outputs[0].token_ids for o in outs], rec


def _tiny_pool_llm(tiny_llama, **engine_args) -> LLM:
    """16 blocks of 8 = 128 tokens for 24 requests of up to 64 tokens each: constant preemption."""
    return LLM(
        str(tiny_llama),
        block_size=8,
        num_gpu_blocks_override=16,
        max_model_len=128,
        max_num_batched_tokens=64,
        **engine_args,
    )


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Greedy outputs with a pool big enough that nothing is ever preempted."""
    llm = LLM(
        str(tiny_llama),
        block_size=8,
        num_gpu_blocks_override=1024,
        max_model_len=128,
        enable_prefix_caching=False,
    )
    prompts = _workload(llm.llm_engine.model_config.vocab_size)
    params = [
        SamplingParams(temperature=0.0, max_tokens=8 + i % 17, ignore_eos=True) for i in range(len(prompts))
    ]
    outs, rec = _run(llm, prompts, params)
    assert rec.sched[-1].num_preemptions_total == 0
    return prompts, params, outs


@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_tiny_pool_preempts_and_loses_nothing(tiny_llama, reference, mode, prefix_caching):
    prompts, params, expected = reference
    llm = _tiny_pool_llm(
        tiny_llama,
        preemption_mode=mode,
        enable_prefix_caching=prefix_caching,
        swap_space=6 * 2 * 2 * 8 * 2 * 16 * 4 / 2**30,  # room for 6 blocks of 2 KiB
    )
    engine = llm.llm_engine
    if mode == "swap":
        assert engine.num_cpu_blocks == 6
    outs, rec = _run(llm, prompts, params)
    assert outs == expected
    final = engine.stats()
    assert final.num_preemptions_total > 0
    assert sum(it.num_preemptions for it in rec.iters) == final.num_preemptions_total
    if mode == "swap":
        assert max(s.num_swapped for s in rec.sched) > 0, "some victims were swapped out"
        assert max(s.cpu_cache_usage for s in rec.sched) > 0
        assert final.num_swap_fallbacks > 0, "a 6-block CPU pool also overflows into recompute"
    else:
        assert all(s.num_swapped == 0 for s in rec.sched)
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert bm.num_free_cpu_blocks == bm.num_cpu_blocks
    assert not bm.block_tables and not bm.cpu_tables
    assert not engine.has_unfinished_requests()


def test_swap_mode_without_fallback(tiny_llama, reference):
    """With a CPU pool that holds everything, every preemption is a swap (no recompute at all)."""
    prompts, params, expected = reference
    llm = _tiny_pool_llm(tiny_llama, preemption_mode="swap", swap_space=0.01, enable_prefix_caching=False)
    outs, rec = _run(llm, prompts, params)
    assert outs == expected
    final = llm.llm_engine.stats()
    assert final.num_preemptions_total > 0 and final.num_swap_fallbacks == 0
    # No recompute: every prompt token is computed exactly once.
    assert sum(it.num_prefill_tokens for it in rec.iters) == sum(len(p) for p in prompts)


def test_prefix_caching_computes_shared_prefixes_once(tiny_llama):
    rng = random.Random(5)
    shared = [rng.randrange(5, 1000) for _ in range(48)]
    prompts = [shared + [rng.randrange(5, 1000) for _ in range(rng.randint(1, 12))] for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    results = {}
    for caching in (False, True):
        llm = LLM(str(tiny_llama), block_size=8, num_gpu_blocks_override=256, enable_prefix_caching=caching)
        # One request first so the shared blocks are cached, then the rest together.
        first, rec1 = _run(llm, prompts[:1], params)
        rest, rec2 = _run(llm, prompts[1:], params)
        computed = sum(it.num_prefill_tokens for it in rec1.iters + rec2.iters)
        results[caching] = (first + rest, computed, llm.llm_engine.stats())
    assert results[True][0] == results[False][0]
    assert results[False][1] == sum(len(p) for p in prompts)
    # The 6 full shared blocks (48 tokens) are computed once instead of 8 times.
    assert results[True][1] == results[False][1] - 7 * 48
    stats = results[True][2]
    assert stats.prefix_cache_queries == sum(len(p) for p in prompts)
    assert stats.prefix_cache_hits == 7 * 48


def test_parallel_sampling_shares_the_prompt_blocks(tiny_llama):
    """n = 4 sequences share their prompt's full blocks through the prefix cache (the first keys them
    as it allocates them; the others, admitted after it in the same step, reuse them); each computes
    its last partial block itself."""
    llm = LLM(str(tiny_llama), block_size=8, num_gpu_blocks_override=64, enable_prefix_caching=True)
    engine = llm.llm_engine
    bm = engine.block_manager
    prompt = list(range(100, 120))  # 20 tokens: blocks of 8 + 8 + 4
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    engine.add_request("group", prompt, params)
    in_use, max_refs = [], []
    outputs = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs = out
        in_use.append(bm.num_blocks - bm.num_free_blocks)
        max_refs.append(max(bm.ref_counts))
    # Step 1: the first sequence prefills all 20 tokens (3 blocks); the other three reuse its 2 full
    # blocks and compute their last 4 tokens each into a block of their own: 2 + 4 instead of
    # 4 x 3 = 12 blocks, and 20 + 3 x 4 = 32 prompt tokens computed instead of 80.
    assert in_use[0] == 6 and max_refs[0] == 4
    assert in_use[1] == 6 and max_refs[1] == 4
    assert engine.stats().prefix_cache_hits == 3 * 16
    assert len(outputs.outputs) == 4
    for i, completion in enumerate(outputs.outputs):
        alone = llm.generate(
            {"prompt_token_ids": prompt},
            SamplingParams(temperature=1.0, seed=11 + i, max_tokens=12, ignore_eos=True),
        )[0]
        assert completion.token_ids == alone.outputs[0].token_ids, f"child {i}"
    assert len({tuple(c.token_ids) for c in outputs.outputs}) > 1, "siblings sample differently"
    assert bm.num_free_blocks == bm.num_blocks
