"""The torch path (the Triton kernels' reference and the CPU backend) against dense float64 attention."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvpilot.kernels import torch_ops

from .conftest import (
    DEVICE,
    DTYPES,
    GARBAGE_K,
    assert_close,
    batch_spans,
    long_len,
    make_paged_batch,
    naive_attention,
)

HEADS = {"mha": (4, 4), "gqa3": (12, 4), "gqa4": (8, 2), "gqa8": (16, 2), "mqa": (4, 1)}
HEAD_SIZES = [64, 80, 96, 128, 256]


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_paged_attention_matches_dense_reference(kind, heads, dtype):
    # Head and block sizes rotate through the grid so that each appears with every kind and dtype.
    i = list(HEADS).index(heads) + 3 * list(DTYPES).index(dtype)
    head_size, block_size = HEAD_SIZES[i % 5], [8, 16, 32][i % 3]
    num_heads, num_kv_heads = HEADS[heads]
    batch = make_paged_batch(
        batch_spans(kind, block_size), num_heads, num_kv_heads, head_size, block_size, DTYPES[dtype], seed=i
    )
    out = torch_ops.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.metadata, batch.scale)
    assert out.dtype == batch.query.dtype and out.shape == batch.query.shape
    assert_close(out, naive_attention(batch), DTYPES[dtype], f"{kind} {heads} d={head_size} bs={block_size}")


def kernel_head_sizes() -> list[int]:
    """Every head size the CPU and Triton kernel matrices compare with ``torch_ops``: the reference
    must itself be checked against float64 at each of them."""
    from tests.kernels import test_cpu_ops, triton_cases

    cases = (*test_cpu_ops.CASES, *triton_cases.ATTENTION_CASES)
    return sorted({case["head_size"] for case in cases} | set(HEAD_SIZES))


@pytest.mark.parametrize("head_size", kernel_head_sizes())
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_every_head_size_the_kernels_use_matches_dense_reference(head_size, dtype):
    batch = make_paged_batch(batch_spans("mixed", 16), 8, 2, head_size, 16, DTYPES[dtype], seed=head_size)
    out = torch_ops.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.metadata, batch.scale)
    assert_close(out, naive_attention(batch), DTYPES[dtype], f"mixed gqa4 d={head_size}")


def test_decode_chunks_sorted_by_length_with_masks(monkeypatch):
    """Tiny chunks: decodes of shuffled lengths regroup into several chunks (index rows, masks)."""
    block_size = 8
    lens = [37, 5, 64, 1, 17, 40, 8, 9, 23, 64, 2, 31]
    spans = [(n - 1, 1) for n in lens] + [(12, 4)]
    batch = make_paged_batch(spans, 8, 2, 64, block_size, torch.float32)
    monkeypatch.setattr(torch_ops, "_DECODE_CHUNK_BYTES", 10 * block_size * 2 * 64 * 4)  # 10 blocks
    out = torch_ops.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.metadata, batch.scale)
    plan = next(iter(batch.metadata.derived.values()))
    assert len(plan.decode_chunks) > 3
    assert any(not isinstance(c.rows, slice) for c in plan.decode_chunks)
    assert any(c.mask is not None for c in plan.decode_chunks)
    assert_close(out, naive_attention(batch), torch.float32, "chunked decodes")


def test_step_plan_is_reused_by_every_layer():
    """The per-step plan (block ids, masks, buffers) is built once and stays correct for another layer's
    cache and queries."""
    layer0 = make_paged_batch(batch_spans("mixed", 16), 8, 2, 64, 16, torch.float32, seed=1)
    layer1 = dataclasses.replace(
        layer0, query=layer0.query * 2, k_cache=layer0.k_cache.flip(-1), v_cache=-layer0.v_cache
    )
    meta = layer0.metadata
    torch_ops.paged_attention(layer0.query, layer0.k_cache, layer0.v_cache, meta, layer0.scale)
    plan = dict(meta.derived)
    out1 = torch_ops.paged_attention(layer1.query, layer1.k_cache, layer1.v_cache, meta, layer1.scale)
    assert meta.derived.keys() == plan.keys()
    assert all(meta.derived[k] is plan[k] for k in plan)
    assert_close(out1, naive_attention(layer1), torch.float32, "second layer")


def test_uniform_decodes_need_no_mask():
    batch = make_paged_batch([(47, 1)] * 5 + [(20, 9)], 4, 4, 64, 16, torch.float32)
    out = torch_ops.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.metadata, batch.scale)
    plan = next(iter(batch.metadata.derived.values()))
    assert all(c.mask is None for c in plan.decode_chunks)
    assert_close(out, naive_attention(batch), torch.float32, "uniform decodes")


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_write_kv_cache_skips_padding_slots(dtype):
    batch = make_paged_batch([(0, 5), (3, 4)], 4, 2, 80, 8, DTYPES[dtype])
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    flat_k, flat_v = k_cache.view(-1, 2, 80), v_cache.view(-1, 2, 80)
    flat_k[batch.metadata.slot_mapping] = GARBAGE_K
    flat_v[batch.metadata.slot_mapping] = GARBAGE_K
    padded = torch.full((batch.key.shape[0] + 2,), -1, dtype=torch.int64, device=DEVICE)
    padded[1:-1] = batch.metadata.slot_mapping
    key = torch.cat([batch.key[:1] * 0 + 99, batch.key, batch.key[:1] * 0 + 99])
    value = torch.cat([batch.value[:1] * 0 + 99, batch.value, batch.value[:1] * 0 + 99])
    torch_ops.write_kv_cache(key, value, k_cache, v_cache, padded)
    assert torch.equal(k_cache, batch.k_cache) and torch.equal(v_cache, batch.v_cache)


def _pool(num_layers: int, num_blocks: int = 12) -> torch.Tensor:
    """The engine's KV pool: one allocation ``[layers, 2, blocks, block_size, kv_heads, head_size]``."""
    return torch.randn(num_layers, 2, num_blocks, 4, 2, 8, device=DEVICE)


@pytest.mark.parametrize("layout", ["engine_pool", "separate"])
def test_copy_blocks(layout):
    data = _pool(3)
    if layout == "engine_pool":
        k_caches, v_caches = [data[i, 0] for i in range(3)], [data[i, 1] for i in range(3)]
        assert torch_ops._stacked_view([*k_caches, *v_caches]) is not None
    else:
        k_caches, v_caches = [data[i, 0].clone() for i in range(3)], [data[i, 1].clone() for i in range(3)]
        assert torch_ops._stacked_view([*k_caches, *v_caches]) is None
    expected = [c.clone() for c in (*k_caches, *v_caches)]
    mapping = torch.tensor([[1, 7], [2, 3], [1, 9]], device=DEVICE)
    for c in expected:
        c[[7, 3, 9]] = c[[1, 2, 1]]
    torch_ops.copy_blocks(k_caches, v_caches, mapping)
    for actual, want in zip((*k_caches, *v_caches), expected, strict=True):
        assert torch.equal(actual, want)
    torch_ops.copy_blocks(k_caches, v_caches, torch.empty(0, 2, dtype=torch.int64, device=DEVICE))


def test_stacked_view_rejects_overlapping_or_uneven_views():
    base = torch.zeros(4, 6, 3)
    assert torch_ops._stacked_view([base[0], base[1], base[3]]) is None  # uneven spacing
    flat = torch.zeros(100)
    overlapping = [flat[i : i + 20].view(4, 5) for i in (0, 10, 20)]
    assert torch_ops._stacked_view(overlapping) is None


def test_swap_blocks_between_pools():
    src = torch.randn(6, 4, 2, 8, device=DEVICE)
    dst = torch.zeros(5, 4, 2, 8)
    torch_ops.swap_blocks(src, dst, torch.tensor([[4, 0], [1, 3]]))
    assert torch.equal(dst[0], src[4].cpu()) and torch.equal(dst[3], src[1].cpu())
    assert not dst[[1, 2, 4]].any()


def test_long_prefill_with_context_and_decodes_against_reference():
    """A chunked prefill continuing a long context next to decodes of very different lengths."""
    bs = 16
    spans = [(long_len(bs) * 5, 1), (3, 1), (200, 37), (0, 70)]
    batch = make_paged_batch(spans, 8, 2, 128, bs, torch.float32, seed=3)
    out = torch_ops.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.metadata, batch.scale)
    assert_close(out, naive_attention(batch), torch.float32, "long context")
