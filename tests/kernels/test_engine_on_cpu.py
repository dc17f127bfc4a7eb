"""The engine on the ``cpu`` backend (the C++ kernel) produces the torch backend's greedy tokens."""

from __future__ import annotations

import random

from kvpilot.engine import LLM, SamplingParams

from .conftest import require_cpu_kernel


def test_engine_greedy_tokens_match_torch_backend(tiny_llama):
    require_cpu_kernel()
    rng = random.Random(0)
    # Lengths around the block size (8), one long enough to be prefilled in several 32-token chunks.
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (1, 7, 8, 9, 17, 45)]
    result = {}
    for backend in ("torch", "cpu"):
        llm = LLM(
            str(tiny_llama),
            device="cpu",
            dtype="float32",
            attention_backend=backend,
            block_size=8,
            max_num_batched_tokens=32,
            num_gpu_blocks_override=64,
            enable_prefix_caching=False,
        )
        try:
            assert llm.llm_engine.backend.name == backend
            outs = llm.generate(
                [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=6)
            )
        finally:
            llm.shutdown()
        result[backend] = [o.outputs[0].token_ids for o in outs]
    assert result["cpu"] == result["torch"]
    assert all(len(tokens) == 6 for tokens in result["torch"])
