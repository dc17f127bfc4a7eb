"""The engine on the ``cpu`` backend (the C++ kernel, the head-major KV pool) produces the torch
backend's greedy tokens (the usual pool), and from a NaN-filled pool the logits of transformers."""

from __future__ import annotations

import random

import torch
import transformers

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.models.synthetic import build_checkpoint
from tests.engine.prompt_logits import prompt_logits

from .conftest import require_cpu_kernel


def greedy_tokens(
    model, prompts: list[list[int]], backend: str, pool_fill: float | None = None, **engine_args
) -> list[list[int]]:
    """Six greedy tokens per prompt from an engine on ``backend``; checks the pool layout it allocates.
    ``pool_fill``: a value written to every slot of the KV pool before the first request."""
    args = dict(dtype="float32", block_size=8, max_num_batched_tokens=32, num_gpu_blocks_override=64)
    llm = LLM(str(model), device="cpu", attention_backend=backend, **{**args, **engine_args})
    try:
        assert llm.llm_engine.backend.name == backend
        cache = llm.llm_engine.runner.kv_cache
        assert cache.head_major == (backend == "cpu")
        if cache.layers[0][0].shape[2] > 1:  # with one KV head the head-major view is contiguous too
            assert cache.layers[0][0].is_contiguous() == (backend == "torch")
        if pool_fill is not None:
            cache.data.fill_(pool_fill)
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=6)
        )
    finally:
        llm.shutdown()
    tokens = [o.outputs[0].token_ids for o in outs]
    assert all(len(t) == 6 for t in tokens)
    return tokens


def greedy_by_backend(
    model, prompts: list[list[int]], prefix_caching: bool, poison_cpu_pool: bool = False
) -> dict[str, list]:
    """``greedy_tokens`` on the torch and the cpu backend. ``poison_cpu_pool``: fill the cpu backend's
    pool (allocated unfilled) with NaN first."""
    return {
        backend: greedy_tokens(
            model,
            prompts,
            backend,
            pool_fill=float("nan") if poison_cpu_pool and backend == "cpu" else None,
            enable_prefix_caching=prefix_caching,
        )
        for backend in ("torch", "cpu")
    }


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


def test_cpu_backend_reads_only_the_slots_it_wrote(tiny_llama):
    """The cpu backend's pool is not zero-filled at start-up: with NaN in every slot before the first
    request, its greedy tokens are still the torch backend's (a slot read before it was written would
    turn a whole row of logits into NaN)."""
    require_cpu_kernel()
    rng = random.Random(1)
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (1, 7, 8, 9, 17, 45)]
    result = greedy_by_backend(tiny_llama, prompts, prefix_caching=False, poison_cpu_pool=True)
    assert result["cpu"] == result["torch"]


def test_bfloat16_paths_read_only_the_slots_they_wrote(tmp_path, tokenizer_dir):
    """The same in bfloat16 on a checkpoint with heads of 64 and 3 query heads per KV head, which
    takes the AVX512-BF16 decode path and the AMX prefill tiles where the CPU has them: a NaN-filled
    pool gives the tokens of a zero-filled one."""
    require_cpu_kernel()
    model = build_checkpoint(
        tmp_path / "d64", tokenizer_dir, hidden_size=192, num_attention_heads=3, num_key_value_heads=1
    )
    rng = random.Random(2)
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (1, 9, 17, 45, 70)]
    args = dict(dtype="bfloat16", block_size=16, max_num_batched_tokens=64)
    clean = greedy_tokens(model, prompts, "cpu", pool_fill=0.0, **args)
    assert greedy_tokens(model, prompts, "cpu", pool_fill=float("nan"), **args) == clean


def test_bfloat16_over_a_nan_pool_is_close_to_transformers(tmp_path, tokenizer_dir):
    """The same NaN-filled bfloat16 pool against a reference that is not the engine: the logits at
    every position of a 70-token prompt prefilled in 16-token chunks (each chunk reads the earlier
    ones' K/V back from the pool, next to slots never written) are finite and within bfloat16's
    rounding of transformers' float32 logits, with the same argmax almost everywhere."""
    require_cpu_kernel()
    model = build_checkpoint(
        tmp_path / "d64", tokenizer_dir, hidden_size=192, num_attention_heads=3, num_key_value_heads=1
    )
    prompt = [random.Random(3).randrange(5, 1000) for _ in range(70)]
    llm = LLM(str(model), device="cpu", dtype="bfloat16", block_size=16, num_gpu_blocks_override=32)
    try:
        llm.llm_engine.runner.kv_cache.data.fill_(float("nan"))
        ours = prompt_logits(llm, prompt, 16).float()
    finally:
        llm.shutdown()
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = hf(torch.tensor([prompt])).logits[0]
    assert torch.isfinite(ours).all()
    # bfloat16 keeps ~3 significant digits; this model's logits are O(1) (as in test_llm_vs_hf).
    assert (ours - reference).abs().max().item() < 0.15
    assert (ours.argmax(-1) == reference.argmax(-1)).float().mean().item() > 0.9
