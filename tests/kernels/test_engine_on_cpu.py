"""The engine on the ``cpu`` backend (the C++ kernel, the head-major KV pool) produces the torch
backend's greedy tokens (the usual pool)."""

from __future__ import annotations

import random

from kvpilot.engine import LLM, SamplingParams

from .conftest import require_cpu_kernel


def greedy_by_backend(model, prompts: list[list[int]], prefix_caching: bool) -> dict[str, list]:
    """Six greedy tokens per prompt on each backend; checks the pool layout each one allocates."""
    result = {}
    for backend in ("torch", "cpu"):
        llm = LLM(
            str(model),
            device="cpu",
            dtype="float32",
            attention_backend=backend,
            block_size=8,
            max_num_batched_tokens=32,
            num_gpu_blocks_override=64,
            enable_prefix_caching=prefix_caching,
        )
        try:
            assert llm.llm_engine.backend.name == backend
            cache = llm.llm_engine.runner.kv_cache
            assert cache.head_major == (backend == "cpu")
            assert cache.layers[0][0].is_contiguous() == (backend == "torch")
            outs = llm.generate(
                [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=6)
            )
        finally:
            llm.shutdown()
        result[backend] = [o.outputs[0].token_ids for o in outs]
    return result


def test_engine_greedy_tokens_match_torch_backend(tiny_llama):
    require_cpu_kernel()
    rng = random.Random(0)
    # Lengths around the block size (8), one long enough to be prefilled in several 32-token chunks.
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (1, 7, 8, 9, 17, 45)]
    result = greedy_by_backend(tiny_llama, prompts, prefix_caching=False)
    assert result["cpu"] == result["torch"]
    assert all(len(tokens) == 6 for tokens in result["torch"])


def test_shared_prefix_blocks_on_the_head_major_pool_match_torch_backend(tiny_llama):
    """Prefix caching shares whole blocks between requests (copy-on-write when one writes)."""
    require_cpu_kernel()
    prompts = [[(7 * i + 3 * n) % 900 + 5 for i in range(n)] for n in (1, 9, 17, 30)]
    prompts.append(prompts[-1][:20] + [11, 12, 13])  # shares whole blocks with the previous prompt
    result = greedy_by_backend(tiny_llama, prompts, prefix_caching=True)
    assert result["cpu"] == result["torch"]
