"""One replica's KV pool as a recording shows it (``vllm:cache_config_info`` and kvpilot's
``kvpilot_kv_pool_info``), and the pool a candidate memory fraction gives (torch-free)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from kvpilot.engine import metrics_names as m
from kvpilot.engine.errors import KVCacheSizeError
from kvpilot.engine.memory import plan_kv_pool
from kvpilot.operator.plan.recording import PlanScrape, RecordingError


@dataclasses.dataclass(frozen=True)
class KVPool:
    """One replica's KV pool as the recording shows it (``vllm:cache_config_info``)."""

    num_gpu_blocks: int
    block_size: int
    gpu_memory_utilization: float | None
    explicit_size: bool
    enable_prefix_caching: bool
    num_cpu_blocks: int
    # What kvpilot's engine sized the pool from (kvpilot_kv_pool_info); None where not exported (vLLM).
    sizing: PoolSizing | None = None

    def blocks_at(
        self,
        gpu_memory_utilization: float,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
    ) -> int:
        """The pool at another memory fraction. With the sizing kvpilot's engine exports, exactly as the
        engine sizes it (``engine.memory.plan_kv_pool``: ``fraction x budget - weights - activations``,
        in whole blocks; the activation peak for the candidate's ``max_num_seqs`` and
        ``max_num_batched_tokens`` when given, as the engine's estimate scales). Without it (vLLM)
        the recording carries neither the device memory nor the weights, so the block count is
        scaled by the fraction itself: ``blocks x new / old``, a lower bound of the real pool whenever
        weights and activations take memory, so a candidate's predicted headroom errs on the safe
        side. A pool sized explicitly does not move."""
        if self.explicit_size:
            return self.num_gpu_blocks
        if self.sizing is not None:
            try:
                plan = plan_kv_pool(
                    block_size=self.block_size,
                    bytes_per_block=self.sizing.bytes_per_block,
                    max_model_len=self.block_size,  # any pool of one block or more is a pool here
                    num_blocks_override=None,
                    kv_cache_memory_bytes=None,
                    gpu_memory_utilization=gpu_memory_utilization,
                    budget_bytes=self.sizing.budget_bytes,
                    weights_bytes=self.sizing.weights_bytes,
                    activation_bytes=self.sizing.activation_at(max_num_seqs, max_num_batched_tokens),
                )
            except KVCacheSizeError:
                return 1  # no room at that fraction: the smallest pool, which cannot keep up
            return max(1, plan.num_blocks)
        if self.gpu_memory_utilization is None:
            return self.num_gpu_blocks
        return max(1, math.floor(self.num_gpu_blocks * gpu_memory_utilization / self.gpu_memory_utilization))


@dataclasses.dataclass(frozen=True)
class PoolSizing:
    """``kvpilot_kv_pool_info``: the memory the fraction applies to, what is taken off it, one block."""

    budget_bytes: int
    weights_bytes: int
    activation_bytes: int
    bytes_per_block: int
    activation_bytes_per_token: int | None = None
    activation_bytes_per_seq: int | None = None

    @classmethod
    def of(cls, labels: Mapping[str, str]) -> PoolSizing | None:
        try:
            values = [int(labels[k]) for k in m.KV_POOL_LABELS[:4]]
        except (KeyError, ValueError):
            return None  # not exported, or sized explicitly ("None")
        if values[0] <= 0 or values[3] <= 0 or min(values) < 0:
            return None
        scaling = []
        for key in m.KV_POOL_LABELS[4:]:
            try:
                scaling.append(max(0, int(labels[key])))
            except (KeyError, ValueError):
                scaling.append(None)
        return cls(*values, *scaling)

    def activation_at(self, max_num_seqs: int | None, max_num_batched_tokens: int | None) -> int:
        """The activation peak for another step shape, as the engine estimates it (its recorded value
        when the coefficients or the shape are unknown)."""
        per_token, per_seq = self.activation_bytes_per_token, self.activation_bytes_per_seq
        if per_token is None or per_seq is None or max_num_batched_tokens is None:
            return self.activation_bytes
        return per_token * max_num_batched_tokens + per_seq * (max_num_seqs or 0)


def pool_of(scrapes: Sequence[PlanScrape]) -> KVPool:
    """The KV pool from the newest scrape that carries ``vllm:cache_config_info``; RecordingError
    when none does."""
    for scrape in sorted(scrapes, key=lambda s: s.time, reverse=True):
        info = scrape.cache_info
        try:
            blocks, block_size = int(info["num_gpu_blocks"]), int(info["block_size"])
        except (KeyError, ValueError):
            continue
        fraction = _float(info.get("gpu_memory_utilization"))
        return KVPool(
            num_gpu_blocks=blocks,
            block_size=block_size,
            gpu_memory_utilization=fraction,
            explicit_size=info.get("num_gpu_blocks_override") not in (None, "", "None"),
            enable_prefix_caching=str(info.get("enable_prefix_caching", "False")).lower() == "true",
            num_cpu_blocks=int(_float(info.get("num_cpu_blocks")) or 0),
            sizing=PoolSizing.of(scrape.pool_info),
        )
    raise RecordingError(
        f"no scrape carries {m.CACHE_CONFIG_INFO} with num_gpu_blocks and block_size: the KV pool is unknown"
    )


def _float(value: str | None) -> float | None:
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None
