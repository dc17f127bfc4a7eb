"""Pure-torch paged-attention and cache ops: the reference for the Triton kernels and the CPU path.

Shapes:
  query:            [num_tokens, num_heads, head_size]
  key, value:       [num_tokens, num_kv_heads, head_size]
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_size]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpilot.kernels.metadata import AttentionMetadata


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each token's K/V in its slot; tokens with a negative slot (padding) are skipped."""
    num_blocks, block_size, num_kv_heads, head_size = k_cache.shape
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_flat = k_cache.view(num_blocks * block_size, num_kv_heads, head_size)
    v_flat = v_cache.view(num_blocks * block_size, num_kv_heads, head_size)
    k_flat.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, kvh, d] gathered by block_ids [..., n] -> [..., n * bs, kvh, d]."""
    num_blocks, block_size, num_kv_heads, head_size = cache.shape
    flat = torch.index_select(cache.view(num_blocks, -1), 0, block_ids.reshape(-1))
    return flat.view(*block_ids.shape[:-1], block_ids.shape[-1] * block_size, num_kv_heads, head_size)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each request's query span over all of its cached tokens.

    Returns ``[num_tokens, num_heads, head_size]`` in the query's dtype. Grouped-query attention:
    query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
    """
    num_tokens, num_heads, head_size = query.shape
    block_size = k_cache.shape[1]
    out = torch.empty_like(query)
    nd = metadata.num_decodes
    gqa = num_heads != k_cache.shape[2]
    if nd:
        derived = metadata.derived
        if "decode_mask" not in derived:
            max_len = max(metadata.seq_lens_host[:nd])
            num_blocks = -(-max_len // block_size)
            positions = torch.arange(num_blocks * block_size, device=query.device)
            mask = positions[None, :] < metadata.seq_lens[:nd, None]
            derived["decode_blocks"] = metadata.block_tables[:nd, :num_blocks].contiguous()
            derived["decode_mask"] = mask[:, None, None, :]
        blocks = derived["decode_blocks"]
        k = _gather(k_cache, blocks).transpose(1, 2)  # [nd, kvh, S, d]
        v = _gather(v_cache, blocks).transpose(1, 2)
        q = query[:nd].unsqueeze(2)  # [nd, h, 1, d]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=derived["decode_mask"], scale=scale, enable_gqa=gqa
        )
        out[:nd] = o.squeeze(2)
    qsl, lens = metadata.query_start_loc_host, metadata.seq_lens_host
    for i in range(nd, metadata.num_reqs):
        start, end, seq_len = qsl[i], qsl[i + 1], lens[i]
        q_len = end - start
        num_blocks = -(-seq_len // block_size)
        blocks = metadata.block_tables[i, :num_blocks]
        k = _gather(k_cache, blocks)[:seq_len].transpose(0, 1)  # [kvh, S, d]
        v = _gather(v_cache, blocks)[:seq_len].transpose(0, 1)
        q = query[start:end].transpose(0, 1)  # [h, q_len, d]
        context = seq_len - q_len
        if context == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            # Query j sits at position context + j and sees keys 0 .. context + j.
            key_pos = torch.arange(seq_len, device=query.device)
            query_pos = torch.arange(context, seq_len, device=query.device)
            mask = key_pos[None, :] <= query_pos[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[start:end] = o.transpose(0, 1)
    return out


def copy_blocks(
    k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], block_mapping: torch.Tensor
) -> None:
    """Copy-on-write: for each row ``(src, dst)`` of ``block_mapping`` [n, 2] int64, in every layer."""
    if block_mapping.numel() == 0:
        return
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    for cache in (*k_caches, *v_caches):
        cache[dst] = cache[src]


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy blocks between pools (device <-> CPU): ``dst_cache[d] = src_cache[s]`` per row ``(s, d)``."""
    if block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0].to(src_cache.device)
    dst = block_mapping[:, 1].to(dst_cache.device)
    dst_cache[dst] = src_cache[src].to(dst_cache.device)
