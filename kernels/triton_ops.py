"""Triton paged-attention and cache ops, with the signatures of ``kvpilot.kernels.torch_ops``.

Shapes (as in ``torch_ops``):
  query:            [num_tokens, num_heads, head_size]
  key, value:       [num_tokens, num_kv_heads, head_size]
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_size]

On CUDA the kernels are compiled; on CPU tensors they run only under the Triton interpreter
(``TRITON_INTERPRET=1`` set before this module is imported), which is how the CPU tests run them.

Attention is one "unified" kernel over the flattened prefill+decode batch. A program owns one KV head
and a tile of ``BLOCK_M`` query rows = ``BLOCK_Q`` consecutive query tokens of one request x the
``num_heads // num_kv_heads`` query heads that share the KV head (so a decode still fills the rows of
``tl.dot``), and walks that request's cached keys in tiles of ``TILE_N`` tokens through its block table,
with an online softmax in fp32::

    program (q_block, kv_head[, segment])
      rows m = 0 .. BLOCK_M-1:  token  q_start + q_block_local * BLOCK_Q + m // group
                                head   kv_head * group + m % group
      keys   0 .. context_len + last query position of the tile (causal, bottom-right aligned)
             key j lives in block_table[req, j // block_size], slot j % block_size

Programs are numbered per request as ``query_start_loc[i] // BLOCK_Q + i + local_block``; this
over-counts by at most one block per request (those programs exit at once) and lets a program find its
request with a binary search over ``query_start_loc`` instead of a host-built map.

For decode batches too small to fill the GPU, the key range is split into ``num_kv_splits`` segments
whose partial results (unnormalised output, running max, running sum) a second kernel merges
(flash-decoding).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvpilot.kernels import torch_ops
from kvpilot.kernels.metadata import AttentionMetadata

__all__ = ["write_kv_cache", "paged_attention", "copy_blocks", "swap_blocks"]

_LOG2E = 1.4426950408889634


@triton.jit
def _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q: tl.constexpr):
    """Largest request i with ``query_start_loc[i] // BLOCK_Q + i <= q_block`` (binary search)."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if start <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# num_reqs is used as a loop-carried bound: keep Triton from specialising it to a constant when it is 1.
@triton.jit(do_not_specialize=["num_reqs"])
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_size]                      (NUM_SEGMENTS == 1)
    seg_out_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS, HEAD_SIZE_PAD] fp32 (NUM_SEGMENTS > 1)
    seg_max_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS] fp32, log2 domain
    seg_sum_ptr,  # [num_tokens, num_heads, NUM_SEGMENTS] fp32
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,  # [num_reqs, max_num_blocks] int32
    seq_lens_ptr,  # [num_reqs] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    qk_scale,  # softmax scale * log2(e): the softmax runs in base 2
    num_reqs,
    stride_q_t,
    stride_q_h,
    stride_q_d,
    stride_o_t,
    stride_o_h,
    stride_o_d,
    stride_k_b,
    stride_k_s,
    stride_k_h,
    stride_k_d,
    stride_v_b,
    stride_v_s,
    stride_v_h,
    stride_v_d,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PAD: tl.constexpr,  # next power of two; lanes >= HEAD_SIZE are masked
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # BLOCK_M // GROUP query tokens per program
    TILE_N: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
    DOT_FP32: tl.constexpr,  # run both dots in fp32 ("ieee"): fp32 inputs, or bf16 under the interpreter
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)

    req = _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + req)
    if q_block_local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_SIZE_PAD)
    offs_n = tl.arange(0, TILE_N)
    q_pos = q_block_local * BLOCK_Q + offs_m // GROUP  # position inside the request's query span
    head = kv_head * GROUP + offs_m % GROUP
    row_valid = (offs_m < BLOCK_Q * GROUP) & (q_pos < q_len)
    d_valid = offs_d < HEAD_SIZE
    token = (q_start + q_pos).to(tl.int64)
    head64 = head.to(tl.int64)

    q_offs = token[:, None] * stride_q_t + head64[:, None] * stride_q_h + offs_d[None, :] * stride_q_d
    q = tl.load(q_ptr + q_offs, mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    # Row r sees keys 0 .. context_len + q_pos[r]; the tile needs keys up to its last valid row's limit.
    key_limit = context_len + q_pos
    last_q_pos = tl.minimum((q_block_local + 1) * BLOCK_Q, q_len) - 1
    num_keys = context_len + last_q_pos + 1
    num_tiles = tl.cdiv(num_keys, TILE_N)
    if NUM_SEGMENTS > 1:
        tiles_per_segment = tl.cdiv(num_tiles, NUM_SEGMENTS)
        tile_lo = segment * tiles_per_segment
        tile_hi = tl.minimum(tile_lo + tiles_per_segment, num_tiles)
    else:
        tile_lo = 0
        tile_hi = num_tiles

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + req.to(tl.int64) * stride_bt
    kv_head64 = kv_head.to(tl.int64)

    for tile in range(tile_lo, tile_hi):
        key_pos = tile * TILE_N + offs_n
        key_valid = key_pos < num_keys
        block = tl.load(table_row + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        slot = (key_pos % BLOCK_SIZE).to(tl.int64)

        k_offs = (
            block[None, :] * stride_k_b
            + slot[None, :] * stride_k_s
            + kv_head64 * stride_k_h
            + offs_d[:, None] * stride_k_d
        )
        k = tl.load(k_cache_ptr + k_offs, mask=d_valid[:, None] & key_valid[None, :], other=0.0)  # [D, N]
        if DOT_FP32:
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k.to(q.dtype))
        s = s * qk_scale
        visible = row_valid[:, None] & key_valid[None, :] & (key_pos[None, :] <= key_limit[:, None])
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row with no visible key yet keeps m = -inf; shift it by 0 so that exp2 gives 0, not NaN.
        m_shift = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp2(s - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]

        v_offs = (
            block[:, None] * stride_v_b
            + slot[:, None] * stride_v_s
            + kv_head64 * stride_v_h
            + offs_d[None, :] * stride_v_d
        )
        v = tl.load(v_cache_ptr + v_offs, mask=key_valid[:, None] & d_valid[None, :], other=0.0)  # [N, D]
        if DOT_FP32:
            acc += tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(p.to(q.dtype), v.to(q.dtype))
        m_i = m_new

    if NUM_SEGMENTS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_offs = token[:, None] * stride_o_t + head64[:, None] * stride_o_h + offs_d[None, :] * stride_o_d
        o_mask = row_valid[:, None] & d_valid[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        # Every segment writes its partials, empty ones included (m = -inf, l = 0), for the merge.
        row = token * tl.num_programs(1) * GROUP + head64  # (token, head) in [num_tokens, num_heads]
        seg_row = row * NUM_SEGMENTS + segment
        tl.store(seg_max_ptr + seg_row, m_i, mask=row_valid)
        tl.store(seg_sum_ptr + seg_row, l_i, mask=row_valid)
        seg_out_offs = seg_row[:, None] * HEAD_SIZE_PAD + offs_d[None, :]
        tl.store(seg_out_ptr + seg_out_offs, acc, mask=row_valid[:, None])


@triton.jit
def _merge_segments_kernel(
    out_ptr,
    seg_out_ptr,
    seg_max_ptr,
    seg_sum_ptr,
    num_heads,
    stride_o_t,
    stride_o_h,
    stride_o_d,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PAD: tl.constexpr,
    NUM_SEGMENTS: tl.constexpr,
):
    """out[t, h] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the key segments s."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, NUM_SEGMENTS)
    offs_d = tl.arange(0, HEAD_SIZE_PAD)
    seg_row = (token * num_heads + head) * NUM_SEGMENTS + offs_s
    seg_max = tl.load(seg_max_ptr + seg_row)
    seg_sum = tl.load(seg_sum_ptr + seg_row)
    m = tl.max(seg_max, axis=0)
    weight = tl.where(seg_max > float("-inf"), tl.exp2(seg_max - m), 0.0)
    total = tl.sum(seg_sum * weight, axis=0)
    acc = tl.load(seg_out_ptr + seg_row[:, None] * HEAD_SIZE_PAD + offs_d[None, :])
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + token * stride_o_t + head * stride_o_h + offs_d * stride_o_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_SIZE,
    )


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _choose_num_kv_splits(metadata: AttentionMetadata, num_kv_heads: int, tile_n: int, device) -> int:
    """Flash-decoding split for decode-only batches that leave most SMs idle; 1 otherwise (and on CPU)."""
    if device.type != "cuda" or metadata.max_query_len != 1:
        return 1
    num_programs = metadata.num_reqs * num_kv_heads  # one busy program per (request, KV head)
    target = 2 * _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if num_programs >= target:
        return 1
    splits = triton.next_power_of_2(triton.cdiv(target, num_programs))
    # Keep at least four key tiles per segment; more splits only add merge traffic.
    max_splits = max(1, triton.next_power_of_2(metadata.max_seq_len // (4 * tile_n) + 1) // 2)
    return max(1, min(splits, max_splits, 16))


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    *,
    num_kv_splits: int | None = None,
) -> torch.Tensor:
    """Causal attention of each request's query span over all of its cached tokens (see ``torch_ops``).

    ``query`` may be a strided view (last dim contiguous or not); returns a new
    ``[num_tokens, num_heads, head_size]`` tensor in the query's dtype. ``num_kv_splits`` (a power of
    two) overrides the flash-decoding split heuristic; it exists for tests and benchmarks.
    """
    num_tokens, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    # tl.dot needs M, N, K >= 16 on GPU (the interpreter does not check): BLOCK_M >= 16 query rows,
    # TILE_N >= 16 keys, and the head dimension padded to a power of two of at least 16.
    head_size_pad = max(16, triton.next_power_of_2(head_size))
    block_m = max(triton.next_power_of_2(group), 64 if metadata.max_query_len >= 64 else 16)
    if head_size_pad >= 256:
        block_m = max(triton.next_power_of_2(group), min(block_m, 32))
    block_q = block_m // group
    tile_n = 16 if head_size_pad >= 256 else 32
    num_q_blocks = num_tokens // block_q + metadata.num_reqs
    if num_kv_splits is None:
        num_kv_splits = _choose_num_kv_splits(metadata, num_kv_heads, tile_n, query.device)
    if num_kv_splits < 1 or num_kv_splits & (num_kv_splits - 1):
        raise ValueError(f"num_kv_splits must be a power of two, got {num_kv_splits}")
    # Interpreter bf16 arithmetic (and tl.dot on bf16) is wrong: upcast there. fp32 stays IEEE on GPU.
    dot_fp32 = query.dtype == torch.float32 or (query.device.type == "cpu" and query.dtype == torch.bfloat16)

    if num_kv_splits > 1:
        seg_out = torch.empty(
            num_tokens, num_heads, num_kv_splits, head_size_pad, dtype=torch.float32, device=query.device
        )
        seg_max = torch.empty(num_tokens, num_heads, num_kv_splits, dtype=torch.float32, device=query.device)
        seg_sum = torch.empty_like(seg_max)
    else:
        seg_out = seg_max = seg_sum = out  # unused by the kernel
    grid = (num_q_blocks, num_kv_heads, num_kv_splits)
    _paged_attention_kernel[grid](
        out,
        seg_out,
        seg_max,
        seg_sum,
        query,
        k_cache,
        v_cache,
        metadata.block_tables,
        metadata.seq_lens,
        metadata.query_start_loc,
        scale * _LOG2E,
        metadata.num_reqs,
        *query.stride(),
        *out.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        metadata.block_tables.stride(0),
        GROUP=group,
        HEAD_SIZE=head_size,
        HEAD_SIZE_PAD=head_size_pad,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=tile_n,
        NUM_SEGMENTS=num_kv_splits,
        DOT_FP32=dot_fp32,
        num_warps=4,
    )
    if num_kv_splits > 1:
        _merge_segments_kernel[(num_tokens, num_heads)](
            out,
            seg_out,
            seg_max,
            seg_sum,
            num_heads,
            *out.stride(),
            HEAD_SIZE=head_size,
            HEAD_SIZE_PAD=head_size_pad,
            NUM_SEGMENTS=num_kv_splits,
        )
    return out


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    num_kv_heads,
    stride_key_t,
    stride_key_h,
    stride_key_d,
    stride_value_t,
    stride_value_h,
    stride_value_d,
    stride_k_b,
    stride_k_s,
    stride_k_h,
    stride_k_d,
    stride_v_b,
    stride_v_s,
    stride_v_h,
    stride_v_d,
    BLOCK_SIZE: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_SIZE_PAD: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    head = (tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)).to(tl.int64)
    offs_d = tl.arange(0, HEAD_SIZE_PAD)
    mask = (head[:, None] < num_kv_heads) & (offs_d[None, :] < HEAD_SIZE)

    k = tl.load(
        key_ptr + token * stride_key_t + head[:, None] * stride_key_h + offs_d[None, :] * stride_key_d,
        mask=mask,
    )
    k_dst = k_cache_ptr + block * stride_k_b + offset * stride_k_s + head[:, None] * stride_k_h
    tl.store(k_dst + offs_d[None, :] * stride_k_d, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(
        value_ptr
        + token * stride_value_t
        + head[:, None] * stride_value_h
        + offs_d[None, :] * stride_value_d,
        mask=mask,
    )
    v_dst = v_cache_ptr + block * stride_v_b + offset * stride_v_s + head[:, None] * stride_v_h
    tl.store(v_dst + offs_d[None, :] * stride_v_d, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each token's K/V in its slot; tokens with a negative slot (padding) are skipped.

    ``key``/``value`` may be strided views (e.g. slices of a fused QKV projection)."""
    num_tokens, num_kv_heads, head_size = key.shape
    if num_tokens == 0:
        return
    block_size = k_cache.shape[1]
    head_size_pad = triton.next_power_of_2(head_size)
    heads_per_program = min(triton.next_power_of_2(num_kv_heads), max(1, 4096 // head_size_pad))
    grid = (num_tokens, triton.cdiv(num_kv_heads, heads_per_program))
    _write_kv_cache_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        num_kv_heads,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        BLOCK_SIZE=block_size,
        HEAD_SIZE=head_size,
        HEAD_SIZE_PAD=head_size_pad,
        HEADS_PER_PROGRAM=heads_per_program,
    )


@triton.jit
def _copy_blocks_kernel(
    storage_ptr,  # the caches' shared storage, as a flat tensor of their dtype
    cache_offsets_ptr,  # [num_caches] int64 element offset of each cache in the storage
    block_mapping_ptr,  # [num_pairs, 2] int64 (src, dst)
    stride_block,
    BLOCK_NUMEL: tl.constexpr,
    CHUNK: tl.constexpr,
):
    cache = tl.program_id(0)
    pair = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_NUMEL
    base = storage_ptr + tl.load(cache_offsets_ptr + cache)
    src = tl.load(block_mapping_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(block_mapping_ptr + 2 * pair + 1).to(tl.int64)
    x = tl.load(base + src * stride_block + offs, mask=mask)
    tl.store(base + dst * stride_block + offs, x, mask=mask)


def _copy_blocks_group(caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """One launch for caches that share a storage, dtype, shape and strides."""
    first = caches[0]
    storage = first.untyped_storage()
    flat = torch.empty(0, dtype=first.dtype, device=first.device)
    flat.set_(storage, 0, (storage.nbytes() // first.element_size(),), (1,))
    offsets = torch.tensor([c.storage_offset() for c in caches], dtype=torch.int64, device=first.device)
    block_numel = first[0].numel()
    chunk = min(triton.next_power_of_2(block_numel), 4096)
    grid = (len(caches), block_mapping.shape[0], triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](
        flat, offsets, block_mapping, first.stride(0), BLOCK_NUMEL=block_numel, CHUNK=chunk
    )


def copy_blocks(
    k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], block_mapping: torch.Tensor
) -> None:
    """Copy-on-write: for each row ``(src, dst)`` of ``block_mapping`` [n, 2] int64, in every layer.

    Destination blocks must be distinct and must not be sources (copy-on-write targets are fresh
    blocks); the copies then commute. Caches that are views of one allocation (the engine's
    ``[layers, 2, blocks, ...]`` pool) are copied in a single launch.
    """
    if block_mapping.numel() == 0:
        return
    block_mapping = block_mapping.to(device=k_caches[0].device, dtype=torch.int64).contiguous()
    groups: dict[tuple, list[torch.Tensor]] = {}
    for cache in (*k_caches, *v_caches):
        inner_contiguous = cache[0].is_contiguous()
        if not inner_contiguous:
            torch_ops.copy_blocks([cache], [], block_mapping)
            continue
        key = (cache.untyped_storage().data_ptr(), cache.dtype, tuple(cache.shape), cache.stride())
        groups.setdefault(key, []).append(cache)
    for caches in groups.values():
        _copy_blocks_group(caches, block_mapping)


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy blocks between pools (device <-> CPU): ``dst_cache[d] = src_cache[s]`` per row ``(s, d)``.

    A Triton kernel cannot address pageable host memory, so this is the torch copy: the transfer is a
    PCIe copy either way and a kernel would add nothing.
    """
    torch_ops.swap_blocks(src_cache, dst_cache, block_mapping)
