"""One rank of a parallel engine: its model shard, KV-cache shard and runner.

The driver holds rank 0 in its own process; each worker process holds one other rank. Both drive a
``Rank`` through the same calls (load, plan, allocate, then execute / apply_block_ops every step).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvpilot.engine.config import EngineArgs
from kvpilot.engine.memory import GiB, KVPoolPlan
from kvpilot.engine.model_runner import KVCache
from kvpilot.engine.models.config import ModelConfig
from kvpilot.engine.parallel.comm import CommSpec, ParallelComm
from kvpilot.engine.parallel.layout import ParallelLayout
from kvpilot.engine.parallel.loader import load_model_shard
from kvpilot.engine.parallel.model import local_config
from kvpilot.engine.parallel.runner import ParallelModelRunner, micro_batch_count, plan_rank_kv_pool
from kvpilot.engine.sampler import Sampler
from kvpilot.engine.scheduler import SchedulerOutput
from kvpilot.kernels import get_backend


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to build itself (picklable: sent to every worker)."""

    model_dir: str
    model_config: ModelConfig
    args: EngineArgs
    layout: ParallelLayout
    comm: CommSpec
    dtype: torch.dtype
    device_type: str  # "cpu" | "cuda" (rank r uses cuda:r)
    attention_backend: str
    max_model_len: int
    max_num_batched_tokens: int


@dataclass(frozen=True)
class RankReport:
    """What a rank holds, reported to the driver at start-up."""

    rank: int
    pid: int
    description: str  # ParallelLayout.describe(rank)
    weight_bytes: int
    kv_bytes_per_block: int


class Rank:
    """Loads the rank's shard from the checkpoint and runs it. ``store`` is the driver's own
    rendezvous store (rank 0 only)."""

    def __init__(self, spec: RankSpec, rank: int, store=None) -> None:
        self.spec = spec
        self.shard = spec.layout.shard(rank)
        self.device = (
            torch.device(spec.device_type, rank) if spec.device_type == "cuda" else torch.device("cpu")
        )
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.comm = ParallelComm(spec.comm, spec.layout, self.shard, self.device, store)
        self.runner: ParallelModelRunner | None = None
        self.plan: KVPoolPlan | None = None

    @property
    def local_config(self) -> ModelConfig:
        return local_config(self.spec.model_config, self.shard)

    def load(self) -> RankReport:
        """Load this rank's shard and build its runner (a sampler on the sampling rank only)."""
        spec = self.spec
        backend = get_backend(spec.attention_backend, spec.device_type)
        torch.manual_seed(spec.args.seed)
        model = load_model_shard(
            spec.model_dir,
            spec.model_config,
            self.shard,
            self.comm,
            backend,
            spec.dtype,
            self.device,
            max(spec.max_model_len, 1),
        )
        sampler = Sampler(spec.args.seed, self.device) if self.shard.is_sampler else None
        self.runner = ParallelModelRunner(
            model,
            backend,
            self.device,
            spec.args.block_size,
            sampler,
            num_micro_batches=micro_batch_count(spec.layout.pipeline_parallel_size),
        )
        return self.report()

    @property
    def kv_bytes_per_block(self) -> int:
        cfg = self.local_config
        return KVCache.bytes_per_block(
            cfg.num_hidden_layers,
            self.spec.args.block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            self.spec.dtype,
        )

    def report(self) -> RankReport:
        """What this rank holds (for the start-up log and the driver's checks)."""
        return RankReport(
            rank=self.shard.rank,
            pid=os.getpid(),
            description=self.spec.layout.describe(self.shard.rank),
            weight_bytes=sum(p.numel() * p.element_size() for p in self.runner.model.parameters()),
            kv_bytes_per_block=self.kv_bytes_per_block,
        )

    def plan_kv(self) -> KVPoolPlan:
        """This rank's own KV plan (the driver then takes the smallest number of blocks of all ranks)."""
        spec, shard = self.spec, self.shard
        if shard.is_sampler:
            logits_vocab = spec.model_config.vocab_size
        elif shard.is_last_stage:
            logits_vocab = shard.num_vocab_rows
        else:
            logits_vocab = 0
        self.plan = plan_rank_kv_pool(
            self.runner,
            self.local_config,
            spec.args,
            spec.dtype,
            self.device,
            spec.max_model_len,
            spec.max_num_batched_tokens,
            logits_vocab,
        )
        return self.plan

    def num_cpu_blocks(self) -> int:
        """Blocks of the CPU swap pool this rank can hold (``swap_space`` GiB per rank, swap mode)."""
        if self.spec.args.preemption_mode != "swap":
            return 0
        return int(self.spec.args.swap_space * GiB) // self.kv_bytes_per_block

    def allocate(self, num_blocks: int, num_cpu_blocks: int) -> None:
        """Allocate this rank's KV cache (its layers and KV heads) and CPU swap pool."""
        self.runner.allocate_kv_cache(num_blocks, num_cpu_blocks)

    def execute(self, out: SchedulerOutput):
        """Run one step over this shard; the sampled tokens on the sampling rank, else None."""
        return self.runner.execute(out)

    def apply_block_ops(self, out: SchedulerOutput) -> None:
        """Swap out, copy, swap in on this rank's KV cache (a step where nothing runs)."""
        self.runner.apply_block_ops(out)

    def abort(self) -> None:
        """Abort the process groups (unblocks NCCL operations waiting on a dead peer)."""
        self.comm.abort()
