"""The head-major KV pool (``KVCache(head_major=True)``): each (block, KV head) is one contiguous run of
``block_size * head_size`` elements, and every layer's K/V is a permuted view of the usual
``[num_blocks, block_size, num_kv_heads, head_size]`` shape. The ``cpu`` backend's ops address the
caches by their strides: on such views they give what the torch reference gives on contiguous caches.
"""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.kv_cache import KVCache
from kvpilot.kernels import cpu_ops, torch_ops

from .conftest import DTYPES, assert_close, batch_spans, make_paged_batch, require_cpu_kernel


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """``cache``'s values in a head-major allocation, viewed as ``[blocks, block_size, heads, d]``."""
    return cache.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)


def test_layer_views_are_contiguous_per_block_and_head():
    kv = KVCache(3, 10, 16, 4, 64, torch.bfloat16, torch.device("cpu"), num_cpu_blocks=5, head_major=True)
    assert kv.data.shape == (3, 2, 10, 4, 16, 64)
    for k, v in kv.layers:
        for cache in (k, v):
            assert cache.shape == (10, 16, 4, 64)
            # block, token, head, element: one head's 16 rows of a block follow one another.
            assert cache.stride() == (4 * 16 * 64, 64, 16 * 64, 1)
    assert kv.blocks_view().shape == (10, 3, 2, 16, 4, 64)
    assert kv.blocks_view(on_cpu=True).shape == (5, 3, 2, 16, 4, 64)
    # A slot written through a layer's view is the same element of blocks_view.
    k1 = kv.layers[1][0]
    k1[7, 3, 2] = torch.arange(64, dtype=torch.bfloat16)
    assert torch.equal(kv.blocks_view()[7, 1, 0, 3, 2], torch.arange(64, dtype=torch.bfloat16))
    assert torch.equal(kv.data[1, 0, 7, 2, 3], torch.arange(64, dtype=torch.bfloat16))


def test_default_layout_is_unchanged():
    kv = KVCache(2, 6, 8, 2, 32, torch.float32, torch.device("cpu"))
    assert not kv.head_major
    assert kv.data.shape == (2, 2, 6, 8, 2, 32)
    assert all(k.is_contiguous() and v.is_contiguous() for k, v in kv.layers)


def test_block_copy_and_swap_on_head_major_pool():
    g = torch.Generator().manual_seed(0)
    kv = KVCache(2, 8, 4, 3, 32, torch.float32, torch.device("cpu"), num_cpu_blocks=4, head_major=True)
    kv.data.copy_(torch.randn(kv.data.shape, generator=g))
    before = kv.blocks_view().clone()  # [blocks, layers, 2, bs, heads, d], contiguous
    layers = kv.layers
    torch_ops.copy_blocks([k for k, _ in layers], [v for _, v in layers], torch.tensor([[1, 5], [2, 6]]))
    expected = before.clone()
    expected[[5, 6]] = before[[1, 2]]
    assert torch.equal(kv.blocks_view(), expected)
    torch_ops.swap_blocks(kv.blocks_view(), kv.blocks_view(on_cpu=True), torch.tensor([[5, 0], [3, 2]]))
    assert torch.equal(kv.blocks_view(on_cpu=True)[[0, 2]], expected[[5, 3]])
    torch_ops.swap_blocks(kv.blocks_view(on_cpu=True), kv.blocks_view(), torch.tensor([[0, 7]]))
    assert torch.equal(kv.blocks_view()[7], expected[5])


@pytest.mark.parametrize(
    "dtype,heads,head_size,block_size,kind",
    [
        ("bfloat16", (12, 4), 64, 16, "decode"),
        ("bfloat16", (8, 8), 128, 8, "mixed"),
        ("bfloat16", (6, 1), 96, 32, "prefill"),
        ("float32", (8, 2), 80, 16, "mixed"),
        ("float16", (4, 4), 256, 16, "decode"),
        ("bfloat16", (12, 4), 48, 16, "mixed"),
    ],
)
@pytest.mark.usefixtures("kernel_isa")
def test_kernel_on_head_major_caches_matches_torch(dtype, heads, head_size, block_size, kind):
    require_cpu_kernel()
    batch = make_paged_batch(
        batch_spans(kind, block_size), *heads, head_size, block_size, DTYPES[dtype], device="cpu", seed=11
    )
    k_hm, v_hm = head_major(batch.k_cache), head_major(batch.v_cache)
    assert k_hm.stride(1) == head_size and k_hm.is_contiguous() == (heads[1] == 1)  # one head: one layout
    out = cpu_ops.paged_attention(batch.query, k_hm, v_hm, batch.fresh_metadata(), batch.scale)
    ref = torch_ops.paged_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.fresh_metadata(), batch.scale
    )
    assert_close(out, ref, DTYPES[dtype], f"head-major {dtype} {heads} d={head_size}")
    # The kernel reads by strides: the same values in either layout give the same bits.
    same = cpu_ops.paged_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.fresh_metadata(), batch.scale
    )
    assert torch.equal(out, same)


@pytest.mark.usefixtures("kernel_isa")
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_write_kv_cache_into_head_major_caches(dtype):
    require_cpu_kernel()
    g = torch.Generator().manual_seed(5)
    num_blocks, block_size, heads, d, num_tokens = 12, 8, 3, 32, 40
    qkv = torch.randn(num_tokens, (4 + 2 * heads) * d, generator=g).to(dtype)
    key = qkv[:, 4 * d : (4 + heads) * d].view(num_tokens, heads, d)
    value = qkv[:, (4 + heads) * d :].view(num_tokens, heads, d)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[::5] = -1
    expected = [torch.randn(num_blocks, block_size, heads, d, generator=g).to(dtype) for _ in range(2)]
    actual = [head_major(t) for t in expected]
    by_torch = [head_major(t) for t in expected]
    torch_ops.write_kv_cache(key, value, *expected, slots)
    cpu_ops.write_kv_cache(key, value, *actual, slots)
    assert not actual[0].is_contiguous()
    assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])
    # The torch op (also the cpu backend's fallback) takes the strided views too.
    torch_ops.write_kv_cache(key, value, *by_torch, slots)
    assert torch.equal(by_torch[0], expected[0]) and torch.equal(by_torch[1], expected[1])
    fallback = [head_major(t) for t in expected]
    cpu_ops.write_kv_cache(key.double(), value.double(), *fallback, slots)  # dtypes differ: the torch op
    assert torch.equal(fallback[0], expected[0]) and torch.equal(fallback[1], expected[1])
