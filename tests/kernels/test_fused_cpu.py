"""The C++ extension's fused decoder-layer ops against the torch ops they replace, and the engine with
them against the engine without them.

bfloat16 (the dtype the model uses them for): rotary and the residual add are bit for bit torch's;
RMSNorm and SiLU x up may differ from torch in the last fp32 bit before a rounding, which can move the
result by two units in the last place (the normalised value and silu(gate) are rounded before the
weight or up multiplies them), on a small fraction of elements. float16 (the scalar path, which the model does
not use: torch's own float16 ops round differently): the same bounds, rotary within two units of its
inputs' magnitude. Hidden sizes that are not a multiple of 16 exercise the masked tails.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.nn.functional as F

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.models.llama import RMSNorm, RotaryEmbedding
from kvpilot.kernels import cpu_ops

# One unit in the last place of values of magnitude up to ~8 (bf16: 8 bits, fp16: 11 bits of mantissa).
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


@pytest.fixture
def fused(kernel_isa):
    """The fused ops of the kernel build of each ISA level this CPU runs (``kernel_isa``)."""
    return cpu_ops.fused_ops()


def _within_ulps(out: torch.Tensor, ref: torch.Tensor, max_fraction: float, ulps: int = 1) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    diff = (out.float() - ref.float()).abs()
    magnitude = torch.maximum(out.float().abs(), ref.float().abs()).clamp(min=2.0**-6)
    bound = ulps * ULP[out.dtype] * magnitude
    assert bool((diff <= bound).all()), f"max diff {diff.max().item()}"
    assert (out != ref).float().mean().item() <= max_fraction


def _norm(hidden: int, dtype: torch.dtype, g: torch.Generator) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = torch.randn(hidden, generator=g) * 0.5 + 1.0
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,hidden", [(1, 768), (7, 100), (64, 256), (33, 4096)])
def test_add_rms_norm_matches_torch(fused, dtype, tokens, hidden):
    g = torch.Generator().manual_seed(tokens * hidden)
    x = (torch.randn(tokens, hidden, generator=g) * 3).to(dtype)
    residual = torch.randn(tokens, hidden, generator=g).to(dtype)
    norm = _norm(hidden, dtype, g)
    with torch.inference_mode():
        ref_out, ref_residual = norm.add_forward(x, residual, None)
        updated = residual.clone()
        out = fused.add_rms_norm_(x, updated, norm.weight, norm.eps)
        plain = fused.rms_norm(x, norm.weight, norm.eps)
        ref_plain = norm(x)
    if dtype == torch.bfloat16:
        assert torch.equal(updated, ref_residual)
    else:
        _within_ulps(updated, ref_residual, 0.01)
    _within_ulps(out, ref_out, 0.02, ulps=2)
    _within_ulps(plain, ref_plain, 0.02, ulps=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_size", [32, 64, 80, 128])
@pytest.mark.parametrize("heads", [(12, 4), (4, 4), (6, 1)])
def test_rotary_in_place_matches_torch(fused, dtype, head_size, heads):
    num_heads, num_kv_heads = heads
    tokens = 19
    g = torch.Generator().manual_seed(head_size * num_heads)
    # q and k as views of one fused QKV output (strided rows), as the model passes them.
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_size, generator=g).to(dtype)
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    angles = torch.rand(tokens, head_size // 2, generator=g) * 100
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(tokens, num_heads, head_size)
    k = k.view(tokens, num_kv_heads, head_size)
    v_before = v.clone()
    ref_q, ref_k = RotaryEmbedding.apply((cos[:, None], sin[:, None]), q, k)
    fused.rotary_(q, k, cos, sin)
    if dtype == torch.bfloat16:
        assert torch.equal(q, ref_q) and torch.equal(k, ref_k)
    else:
        # A rotated value is a sum of two rounded products that can cancel: the bound is an ulp of the
        # products (at most the input's magnitude), not of the sum.
        scale = qkv[:, : q_size + kv_size].float().abs().max().item()
        for out, ref in ((q, ref_q), (k, ref_k)):
            torch.testing.assert_close(out, ref, atol=2 * ULP[dtype] * scale, rtol=0)
    assert torch.equal(v, v_before)  # the V columns of the shared tensor are untouched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,inter", [(1, 2048), (5, 37), (64, 512)])
def test_silu_and_mul_matches_torch(fused, dtype, tokens, inter):
    g = torch.Generator().manual_seed(tokens + inter)
    gate_up = (torch.randn(tokens, 2 * inter, generator=g) * 4).to(dtype)
    gate, up = gate_up.split(inter, dim=-1)
    ref = F.silu(gate) * up
    out = fused.silu_and_mul(gate_up)
    # silu(gate) is rounded before up multiplies it: a last-bit difference there moves the product by up
    # to two units in its last place, as RMSNorm's rounded normalised value does.
    _within_ulps(out, ref, 0.01, ulps=2)


def test_fused_ops_reject_other_dtypes(fused):
    x = torch.randn(4, 32, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        fused.rms_norm(x, torch.ones(32, dtype=torch.float64), 1e-5)


def test_engine_tokens_with_and_without_fused_ops(tiny_llama, fused):
    """bfloat16 on the cpu backend: the fused ops (the default there) give the greedy tokens of the
    same engine running the torch elementwise ops."""
    rng = random.Random(1)
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (3, 9, 30)]
    llm = LLM(
        str(tiny_llama),
        device="cpu",
        dtype="bfloat16",
        attention_backend="cpu",
        block_size=8,
        num_gpu_blocks_override=64,
        enable_prefix_caching=False,
    )
    try:
        model = llm.llm_engine.model
        assert model.backend.fused is not None
        params = SamplingParams(temperature=0.0, max_tokens=8)
        with_fused = [
            o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        ]
        for module in model.modules():
            if getattr(module, "backend", None) is not None:
                module.backend = dataclasses.replace(module.backend, fused=None)
        without = [
            o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        ]
    finally:
        llm.shutdown()
    assert with_fused == without
    assert all(len(t) == 8 for t in without)
