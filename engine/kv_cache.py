"""The KV cache tensors of one rank: every layer's K and V block pools in one allocation, and the CPU
swap pool beside them."""

from __future__ import annotations

import torch


class KVCache:
    """Per-layer K and V block pools: each ``[num_blocks, block_size, num_kv_heads, head_size]``.

    One allocation holds every layer (``[num_layers, 2, num_blocks, ...]``) so that block copies and
    swaps are single indexing ops across layers.

    ``head_major`` (for the ``cpu`` backend): the allocation is ``[num_layers, 2, num_blocks,
    num_kv_heads, block_size, head_size]``, so that one KV head's rows of a block are contiguous
    (``block_size * head_size`` elements, one run the hardware prefetcher follows, instead of
    ``block_size`` short runs strided by all heads), and each layer's K and V are permuted views of the
    usual shape. Every backend's cache ops take such views; the ``cpu`` backend's kernels, which
    address the caches by their strides, are the ones it speeds up. The swap pool has the same layout,
    so block copies and swaps move whole blocks as before.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_cpu_blocks: int = 0,
        head_major: bool = False,
        zero_fill: bool = True,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.head_major = head_major
        inner = (num_kv_heads, block_size) if head_major else (block_size, num_kv_heads)
        # zero_fill: the torch and Triton paths read masked-out padding slots, which must stay finite.
        # A backend that reads only the slots written (the cpu one) gets the pool unfilled: its pages
        # are then faulted in as the pool fills instead of all at start-up (zero-filling a 4 GiB pool
        # took 9 s of a 12.6 s start on one thread), so every restart is that much faster.
        alloc = torch.zeros if zero_fill else torch.empty
        self.data = alloc((num_layers, 2, num_blocks, *inner, head_size), dtype=dtype, device=device)
        self.layers = [
            (self._layer_view(self.data[i, 0]), self._layer_view(self.data[i, 1])) for i in range(num_layers)
        ]
        # The swap pool lives in host memory (pinned on CUDA so that copies are asynchronous DMA).
        cpu_shape = (num_layers, 2, num_cpu_blocks, *inner, head_size)
        pin = device.type == "cuda"
        self.cpu_data = (
            alloc(cpu_shape, dtype=dtype, device="cpu", pin_memory=pin) if num_cpu_blocks else None
        )

    def _layer_view(self, pool: torch.Tensor) -> torch.Tensor:
        """One layer's K or V pool as ``[num_blocks, block_size, num_kv_heads, head_size]``."""
        return pool.permute(0, 2, 1, 3) if self.head_major else pool

    def blocks_view(self, on_cpu: bool = False) -> torch.Tensor:
        """The pool with the block dimension first: ``[num_blocks, num_layers, 2, block_size, heads, d]``
        (a strided view when ``head_major``)."""
        data = self.cpu_data if on_cpu else self.data
        if self.head_major:
            return data.permute(2, 0, 1, 4, 3, 5)
        return data.permute(2, 0, 1, 3, 4, 5)

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_size: int, dtype) -> int:
        return (
            2
            * num_layers
            * block_size
            * num_kv_heads
            * head_size
            * torch.empty((), dtype=dtype).element_size()
        )
