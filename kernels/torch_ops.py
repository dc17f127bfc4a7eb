"""Pure-torch paged-attention and cache ops: the reference for the Triton kernels and the CPU path.

Shapes:
  query:            [num_tokens, num_heads, head_size]
  key, value:       [num_tokens, num_kv_heads, head_size]
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_size]

How attention runs on CPU: each request's blocks are gathered with ``index_select`` into a contiguous
buffer and ``scaled_dot_product_attention`` reads the buffer as a strided
``[reqs, kv_heads, tokens, head_size]`` view (no transpose copy).

- The gather buffers are allocated once per step (in ``metadata.derived``) and reused by every layer
  and every chunk: gathering into fresh tensors costs page faults on every layer.
- Decodes are sorted by length and attended in as few chunks as possible (see
  ``_DECODE_CHUNK_BYTES``): a chunk is padded only to its own longest member.
- Block ids, masks and the chunking are computed once per step, not once per layer; chunks whose
  members all fill their blocks exactly need no mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpilot.kernels.metadata import AttentionMetadata

# Decodes are attended in as few chunks as possible: every op is a parallel region, and on a busy CPU
# each one can wait a scheduler slice for a descheduled thread (measured: time grew in proportion to
# the number of chunks with two threads on a loaded machine, while one thread gained little from
# cache-sized chunks). A chunk is cut only to bound the gather buffers (bytes of K, as many of V) and
# to keep padding, which SDPA computes over like real keys, under a quarter of the real keys.
_DECODE_CHUNK_BYTES = 64 << 20
_DECODE_CHUNK_BYTES_DEVICE = 256 << 20
_MAX_PADDING = 0.25


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each token's K/V in its slot; tokens with a negative slot (padding) are skipped. The caches
    may be strided views (the head-major pool's): their slots are then addressed as (block, offset)."""
    num_blocks, block_size, num_kv_heads, head_size = k_cache.shape
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    for cache, rows in ((k_cache, key), (v_cache, value)):
        rows = rows.to(cache.dtype)
        if cache.is_contiguous():
            cache.view(num_blocks * block_size, num_kv_heads, head_size).index_copy_(0, slot_mapping, rows)
        else:
            cache.index_put_((slot_mapping // block_size, slot_mapping % block_size), rows)


@dataclass
class _DecodeChunk:
    """Decode requests attended together: ``rows`` (a slice when they are consecutive) index both the
    requests and their query tokens."""

    rows: slice | torch.Tensor
    num_reqs: int
    num_blocks: int  # blocks gathered per request (padded to the chunk's longest)
    block_ids: torch.Tensor  # [num_reqs * num_blocks] int64
    mask: torch.Tensor | None  # [num_reqs, 1, 1, num_blocks * block_size] bool; None = all keys valid


@dataclass
class _Prefill:
    start: int
    end: int
    seq_len: int
    block_ids: torch.Tensor  # [ceil(seq_len / block_size)] int64
    mask: torch.Tensor | None  # [q_len, seq_len] bool; None = plain causal (no cached context)


@dataclass
class _StepPlan:
    """Everything ``paged_attention`` derives from the metadata, once per step."""

    decode_chunks: list[_DecodeChunk]
    prefills: list[_Prefill]
    k_buffer: torch.Tensor  # [max blocks gathered at once, block_size, num_kv_heads, head_size]
    v_buffer: torch.Tensor


def _plan_decodes(metadata: AttentionMetadata, block_size: int, bytes_per_block: int) -> list[_DecodeChunk]:
    nd = metadata.num_decodes
    lens = metadata.seq_lens_host[:nd]
    order = sorted(range(nd), key=lambda i: lens[i])  # stable: equal lengths keep batch order
    device = metadata.block_tables.device
    budget = _DECODE_CHUNK_BYTES if device.type == "cpu" else _DECODE_CHUNK_BYTES_DEVICE
    chunks: list[_DecodeChunk] = []
    i = 0
    while i < nd:
        # Sorted ascending, so the newest member decides every member's padded length.
        j, real_tokens = i + 1, lens[order[i]]
        while j < nd:
            padded_blocks = (j + 1 - i) * -(-lens[order[j]] // block_size)
            if padded_blocks * bytes_per_block > budget:
                break
            if padded_blocks * block_size > (1 + _MAX_PADDING) * (real_tokens + lens[order[j]]):
                break
            real_tokens += lens[order[j]]
            j += 1
        members = order[i:j]
        num_blocks = -(-lens[members[-1]] // block_size)
        if members == list(range(members[0], members[0] + len(members))):
            rows: slice | torch.Tensor = slice(members[0], members[-1] + 1)
            tables = metadata.block_tables[rows, :num_blocks]
        else:
            rows = torch.tensor(members, dtype=torch.int64, device=device)
            tables = metadata.block_tables.index_select(0, rows)[:, :num_blocks]
        mask = None
        if any(lens[m] != num_blocks * block_size for m in members):
            positions = torch.arange(num_blocks * block_size, device=device)
            chunk_lens = torch.tensor([lens[m] for m in members], device=device)
            mask = (positions[None, :] < chunk_lens[:, None])[:, None, None, :]
        chunks.append(_DecodeChunk(rows, len(members), num_blocks, tables.reshape(-1).long(), mask))
        i = j
    return chunks


def _plan_prefills(metadata: AttentionMetadata, block_size: int) -> list[_Prefill]:
    qsl, lens = metadata.query_start_loc_host, metadata.seq_lens_host
    device = metadata.block_tables.device
    prefills = []
    for i in range(metadata.num_decodes, metadata.num_reqs):
        start, end, seq_len = qsl[i], qsl[i + 1], lens[i]
        if end == start:
            continue
        context = seq_len - (end - start)
        block_ids = metadata.block_tables[i, : -(-seq_len // block_size)].long()
        mask = None
        if context:
            # Query j sits at position context + j and sees keys 0 .. context + j.
            key_pos = torch.arange(seq_len, device=device)
            query_pos = torch.arange(context, seq_len, device=device)
            mask = key_pos[None, :] <= query_pos[:, None]
        prefills.append(_Prefill(start, end, seq_len, block_ids, mask))
    return prefills


def _step_plan(metadata: AttentionMetadata, k_cache: torch.Tensor) -> _StepPlan:
    _, block_size, num_kv_heads, head_size = k_cache.shape
    key = ("torch_plan", block_size, num_kv_heads, head_size, k_cache.dtype, k_cache.device)
    plan = metadata.derived.get(key)
    if plan is None:
        bytes_per_block = k_cache[0].numel() * k_cache.element_size()
        chunks = _plan_decodes(metadata, block_size, bytes_per_block)
        prefills = _plan_prefills(metadata, block_size)
        max_blocks = max(
            [c.block_ids.numel() for c in chunks] + [p.block_ids.numel() for p in prefills], default=0
        )
        shape = (max_blocks, block_size, num_kv_heads, head_size)
        plan = _StepPlan(
            chunks,
            prefills,
            torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device),
            torch.empty(shape, dtype=k_cache.dtype, device=k_cache.device),
        )
        metadata.derived[key] = plan
    return plan


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """``cache[block_ids]`` written into ``buffer``: [n, block_size, num_kv_heads, head_size]."""
    return torch.index_select(cache, 0, block_ids, out=buffer[: block_ids.numel()])


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each request's query span over all of its cached tokens.

    Returns ``[num_tokens, num_heads, head_size]`` in the query's dtype; caches of a narrower type
    (a bfloat16 pool under float32 compute) are widened to it as they are read. Grouped-query attention:
    query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``. Per-step state (block ids,
    masks, gather buffers) is kept in ``metadata.derived`` and reused by every layer.
    """
    num_tokens, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    gqa = num_heads != num_kv_heads
    plan = _step_plan(metadata, k_cache)
    out = torch.empty_like(query)
    for chunk in plan.decode_chunks:
        num_keys = chunk.num_blocks * block_size
        k = _gather(k_cache, chunk.block_ids, plan.k_buffer)
        v = _gather(v_cache, chunk.block_ids, plan.v_buffer)
        # [reqs * blocks, bs, kvh, d] -> [reqs, kvh, keys, d] as a strided view: SDPA reads it in place.
        k = k.view(chunk.num_reqs, num_keys, num_kv_heads, head_size).transpose(1, 2).to(query.dtype)
        v = v.view(chunk.num_reqs, num_keys, num_kv_heads, head_size).transpose(1, 2).to(query.dtype)
        if isinstance(chunk.rows, slice):
            q = query[chunk.rows]
        else:
            q = query.index_select(0, chunk.rows)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), k, v, attn_mask=chunk.mask, scale=scale, enable_gqa=gqa
        ).squeeze(2)
        if isinstance(chunk.rows, slice):
            out[chunk.rows] = o
        else:
            out.index_copy_(0, chunk.rows, o)
    for p in plan.prefills:
        k = _gather(k_cache, p.block_ids, plan.k_buffer).flatten(0, 1)[: p.seq_len].transpose(0, 1)
        v = _gather(v_cache, p.block_ids, plan.v_buffer).flatten(0, 1)[: p.seq_len].transpose(0, 1)
        k, v = k.to(query.dtype), v.to(query.dtype)
        q = query[p.start : p.end].transpose(0, 1)  # [h, q_len, d]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=gqa
        )
        out[p.start : p.end] = o.transpose(0, 1)
    return out


def _stacked_view(caches: list[torch.Tensor]) -> torch.Tensor | None:
    """The caches as one ``[num_caches, num_blocks, ...]`` view when they are equally spaced views of one
    storage with one shape, stride and dtype (the engine's ``[layers, 2, blocks, ...]`` pool); else None."""
    first = caches[0]
    same = all(
        c.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and c.dtype == first.dtype
        and c.shape == first.shape
        and c.stride() == first.stride()
        for c in caches
    )
    if not same or len(caches) < 2:
        return None
    offsets = sorted(c.storage_offset() for c in caches)
    step = offsets[1] - offsets[0]
    if step <= 0 or any(b - a != step for a, b in zip(offsets, offsets[1:], strict=False)):
        return None
    # Views must not overlap, or writes through one cache would show in another.
    span = sum((n - 1) * s for n, s in zip(first.shape, first.stride(), strict=True)) + 1
    if step < span:
        return None
    return first.as_strided((len(caches), *first.shape), (step, *first.stride()), offsets[0])


def copy_blocks(
    k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], block_mapping: torch.Tensor
) -> None:
    """Copy-on-write: for each row ``(src, dst)`` of ``block_mapping`` [n, 2] int64, in every layer.

    All sources are read before any destination is written. Caches that are views of one allocation
    are copied with a single indexing op.
    """
    if block_mapping.numel() == 0:
        return
    caches = [*k_caches, *v_caches]
    block_mapping = block_mapping.to(caches[0].device)
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    stacked = _stacked_view(caches)
    if stacked is not None:
        stacked[:, dst] = stacked[:, src]
        return
    for cache in caches:
        cache[dst] = cache[src]


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy blocks between pools (device <-> CPU): ``dst_cache[d] = src_cache[s]`` per row ``(s, d)``."""
    if block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0].to(src_cache.device)
    dst = block_mapping[:, 1].to(dst_cache.device)
    dst_cache[dst] = src_cache[src].to(dst_cache.device)
