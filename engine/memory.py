"""KV-pool sizing: how many blocks fit in the memory the engine may use.

KV pool = gpu_memory_utilization x device memory - weights - peak activations. On CUDA the peak is
measured by a profiling forward at ``max_num_batched_tokens`` with the allocator's peak statistics; on
CPU "device memory" is the process memory budget (``cpu_memory_budget_bytes``, default half of RAM)
and the activation peak is estimated from the step shape (the CPU allocator keeps no peak statistics).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvpilot.engine.errors import KVCacheSizeError

GiB = 1 << 30


def format_bytes(n: int) -> str:
    """``3.20 GiB`` / ``12.5 MiB``: GiB from 1 GiB up, MiB below."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / (1 << 20):.1f} MiB"


@dataclass
class KVPoolPlan:
    num_blocks: int
    block_size: int
    bytes_per_block: int
    budget_bytes: int | None  # memory the fraction applies to (None: sized explicitly)
    weights_bytes: int
    activation_bytes: int
    # How the activation peak scales with the step shape (bytes per batched token and per sequence),
    # so that a planner can size the pool for another max_num_batched_tokens / max_num_seqs: the
    # estimate's own coefficients on CPU; on CUDA the profiled peak over the tokens profiled.
    activation_bytes_per_token: int | None = None
    activation_bytes_per_seq: int | None = None

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self, max_model_len: int) -> str:
        """The start-up line, e.g. ``KV cache: 3.20 GiB, 1,024 blocks x 16 tokens = 16,384 tokens; ...``."""
        return (
            f"KV cache: {format_bytes(self.kv_bytes)}, {self.num_blocks:,} blocks x {self.block_size} "
            "tokens = "
            f"{self.num_tokens:,} tokens; max concurrency at max_model_len {max_model_len:,}: "
            f"{self.num_tokens / max_model_len:.1f}x"
        )


def num_cpu_swap_blocks(preemption_mode: str, swap_space_gib: float, bytes_per_block: int) -> int:
    """Blocks of the CPU swap pool: ``swap_space`` GiB of host memory (per rank), in swap mode only."""
    return int(swap_space_gib * GiB) // bytes_per_block if preemption_mode == "swap" else 0


def total_system_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_activation_estimate(
    num_tokens: int,
    hidden: int,
    intermediate: int,
    qkv_size: int,
    vocab: int,
    num_seqs: int,
    dtype_bytes: int,
) -> int:
    """Upper estimate of live activation bytes in one CPU forward of ``num_tokens`` tokens: the
    residual stream, norm output (float32 inside RMSNorm), fused qkv, attention output, gate/up and
    SiLU products, plus float32 logits for the sampled rows."""
    per_token = (4 * hidden * 4) + dtype_bytes * (qkv_size + hidden + 3 * intermediate)
    logits = num_seqs * vocab * 4 * 3  # logits, penalised copy, probabilities
    return num_tokens * per_token + logits


def plan_kv_pool(
    *,
    block_size: int,
    bytes_per_block: int,
    max_model_len: int,
    num_blocks_override: int | None,
    kv_cache_memory_bytes: int | None,
    gpu_memory_utilization: float,
    budget_bytes: int,
    weights_bytes: int,
    activation_bytes: int,
    already_used_bytes: int = 0,
) -> KVPoolPlan:
    """Decide the number of KV blocks; raise ``KVCacheSizeError`` (with numbers and fixes) when even
    one request of ``max_model_len`` tokens cannot fit."""
    if num_blocks_override is not None:
        num_blocks = num_blocks_override
        budget = None
    elif kv_cache_memory_bytes is not None:
        num_blocks = kv_cache_memory_bytes // bytes_per_block
        budget = None
    else:
        budget = budget_bytes
        available = (
            int(gpu_memory_utilization * budget_bytes) - weights_bytes - activation_bytes - already_used_bytes
        )
        num_blocks = max(0, available) // bytes_per_block
    plan = KVPoolPlan(num_blocks, block_size, bytes_per_block, budget, weights_bytes, activation_bytes)
    needed_blocks = -(-max_model_len // block_size)
    if num_blocks < needed_blocks:
        need = needed_blocks * bytes_per_block
        if budget is None:
            how = "raise num_gpu_blocks_override / kv_cache_memory_bytes"
        else:
            how = (
                f"raise gpu_memory_utilization (now {gpu_memory_utilization}; weights take "
                f"{format_bytes(weights_bytes)} and activations {format_bytes(activation_bytes)} of the "
                f"{format_bytes(budget_bytes)} budget)"
            )
        raise KVCacheSizeError(
            f"the KV cache holds {num_blocks} blocks x {block_size} = {num_blocks * block_size} tokens "
            f"({format_bytes(plan.kv_bytes)}), but one request of max_model_len {max_model_len} needs "
            f"{needed_blocks} blocks ({format_bytes(need)}). Fix: {how}, or lower max_model_len to at most "
            f"{num_blocks * block_size}."
        )
    return plan
