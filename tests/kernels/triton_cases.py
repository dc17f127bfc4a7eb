"""The Triton kernels against the torch reference: interpreted on CPU, compiled on CUDA.

Not collected by a plain ``pytest tests/``: ``test_triton_ops.py`` runs this file in a child pytest,
with ``TRITON_INTERPRET=1`` on CPU, because triton reads that variable when it is first imported (its
own ``tl.cdiv``, ``tl.max``, ... are jitted then) and the session may have imported it already.
On a GPU machine it can also be run directly: ``pytest tests/kernels/triton_cases.py``.

The attention matrix (5 head sizes x 3 dtypes x 3 block sizes x 5 head layouts x 3 batch kinds x
split-KV on/off) is covered pairwise rather than in full; every batch kind already mixes the lengths
1, bs-1, bs, bs+1 and long (see ``batch_spans``).
"""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels import torch_ops

from .conftest import (
    DEVICE,
    DTYPES,
    GARBAGE_K,
    HEADS,
    assert_close,
    batch_spans,
    make_paged_batch,
    naive_attention,
    pairwise,
)

ATTENTION_CASES = pairwise(
    {
        "head_size": [64, 80, 96, 128, 256],
        "dtype": list(DTYPES),
        "heads": list(HEADS),
        "block_size": [8, 16, 32],
        # Split-KV (flash-decoding) is what the heuristic picks for decode-only batches on a GPU.
        "kind": ["decode", "decode/split4", "prefill", "mixed"],
    }
)


def _case_id(case: dict) -> str:
    return "-".join(f"{v}" for v in case.values())


def _run_both(triton_ops, batch, **kwargs):
    out = triton_ops.paged_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.fresh_metadata(), batch.scale, **kwargs
    )
    ref = torch_ops.paged_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.fresh_metadata(), batch.scale
    )
    return out, ref


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=_case_id)
def test_paged_attention_matches_torch(triton_ops, case):
    dtype = DTYPES[case["dtype"]]
    num_heads, num_kv_heads = HEADS[case["heads"]]
    kind, _, splits = case["kind"].partition("/split")
    batch = make_paged_batch(
        batch_spans(kind, case["block_size"]),
        num_heads,
        num_kv_heads,
        case["head_size"],
        case["block_size"],
        dtype,
        seed=ATTENTION_CASES.index(case),
    )
    out, ref = _run_both(triton_ops, batch, num_kv_splits=int(splits or 1))
    assert out.dtype == dtype and out.shape == batch.query.shape
    assert_close(out, ref, dtype, _case_id(case))


def test_split_kv_with_empty_segments(triton_ops):
    """Eight key segments over a 1-token and a 700-token context: most of the short one's are empty."""
    batch = make_paged_batch([(0, 1), (699, 1), (130, 1)], 8, 2, 64, 16, torch.float32)
    out, ref = _run_both(triton_ops, batch, num_kv_splits=8)
    assert_close(out, ref, torch.float32, "split-KV")
    assert_close(out, naive_attention(batch), torch.float32, "split-KV vs dense")


def test_split_kv_on_a_mixed_batch(triton_ops):
    """The split path is correct for query spans longer than one token too (causal rows per segment)."""
    batch = make_paged_batch([(5, 1), (70, 1), (20, 3), (0, 4)], 4, 2, 64, 8, torch.float16, seed=5)
    out, ref = _run_both(triton_ops, batch, num_kv_splits=2)
    assert_close(out, ref, torch.float16, "split-KV mixed")


def test_offsets_past_int32(triton_ops):
    """Blocks whose element offsets exceed 2**31 (the cache is 4.3 GB, allocated lazily on CPU)."""
    block_size, num_kv_heads, head_size = 16, 1, 64
    first = (1 << 31) // (block_size * num_kv_heads * head_size) + 5
    spans = [(40, 1), (0, 19), (17, 6)]
    batch = make_paged_batch(
        spans,
        4,
        num_kv_heads,
        head_size,
        block_size,
        torch.float16,
        first_block_id=first,
        num_blocks=first + 16,
    )
    assert batch.k_cache.numel() > 2**31
    out, ref = _run_both(triton_ops, batch)
    assert_close(out, ref, torch.float16, "int64 offsets")

    k_cache, v_cache = batch.k_cache, batch.v_cache
    slots = batch.metadata.slot_mapping
    k_cache.view(-1, num_kv_heads, head_size)[slots] = GARBAGE_K
    v_cache.view(-1, num_kv_heads, head_size)[slots] = GARBAGE_K
    triton_ops.write_kv_cache(batch.key, batch.value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, num_kv_heads, head_size)[slots], batch.key)
    assert torch.equal(v_cache.view(-1, num_kv_heads, head_size)[slots], batch.value)


def test_rejects_bad_arguments(triton_ops):
    batch = make_paged_batch([(3, 1)], 4, 4, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="power of two"):
        triton_ops.paged_attention(
            batch.query, batch.k_cache, batch.v_cache, batch.metadata, 1.0, num_kv_splits=3
        )
    with pytest.raises(ValueError, match="multiple"):
        triton_ops.paged_attention(
            batch.query[:, :3], batch.k_cache[..., :2, :], batch.v_cache[..., :2, :], batch.metadata, 1.0
        )


@pytest.mark.parametrize(
    "dtype,head_size,num_kv_heads,block_size",
    [
        ("float32", 64, 1, 8),
        ("float16", 80, 4, 16),
        ("bfloat16", 256, 2, 32),
        ("bfloat16", 96, 3, 16),
        ("float16", 128, 8, 8),
    ],
)
def test_write_kv_cache_matches_torch(triton_ops, dtype, head_size, num_kv_heads, block_size):
    """Strided key/value (views of a fused QKV tensor) into their slots; negative slots are skipped."""
    batch = make_paged_batch(
        [(0, 7), (block_size - 1, 3), (0, 1)],
        num_kv_heads,
        num_kv_heads,
        head_size,
        block_size,
        DTYPES[dtype],
    )
    slots = batch.metadata.slot_mapping.clone()
    slots[[2, 8]] = -1  # padding tokens
    expected = [batch.k_cache.clone(), batch.v_cache.clone()]
    actual = [batch.k_cache.clone(), batch.v_cache.clone()]
    for caches in (expected, actual):
        for cache in caches:
            cache.view(-1, num_kv_heads, head_size)[batch.metadata.slot_mapping] = GARBAGE_K
    torch_ops.write_kv_cache(batch.key, batch.value, *expected, slots)
    triton_ops.write_kv_cache(batch.key, batch.value, *actual, slots)
    assert not batch.key.is_contiguous()
    assert torch.equal(actual[0], expected[0]) and torch.equal(actual[1], expected[1])
    skipped = batch.metadata.slot_mapping[[2, 8]]
    assert (actual[0].view(-1, num_kv_heads, head_size)[skipped] == GARBAGE_K).all()


@pytest.mark.parametrize("layout", ["engine_pool", "separate"])
def test_copy_blocks_matches_torch(triton_ops, layout):
    data = torch.randn(3, 2, 12, 8, 2, 80, device=DEVICE).to(torch.bfloat16)
    if layout == "engine_pool":
        caches = [data[i, j] for i in range(3) for j in range(2)]
    else:
        caches = [data[i, j].clone() for i in range(3) for j in range(2)]
    expected = [c.clone() for c in caches]
    mapping = torch.tensor([[1, 7], [2, 3], [1, 9], [11, 0]], device=DEVICE)
    torch_ops.copy_blocks(expected[0::2], expected[1::2], mapping)
    triton_ops.copy_blocks(caches[0::2], caches[1::2], mapping)
    for actual, want in zip(caches, expected, strict=True):
        assert torch.equal(actual, want)


def test_swap_blocks_is_the_torch_copy(triton_ops):
    src = torch.randn(6, 4, 2, 64, device=DEVICE)
    dst = torch.zeros(5, 4, 2, 64)
    triton_ops.swap_blocks(src, dst, torch.tensor([[4, 0], [1, 3]]))
    assert torch.equal(dst[0], src[4].cpu()) and torch.equal(dst[3], src[1].cpu())
    assert not dst[[1, 2, 4]].any()
