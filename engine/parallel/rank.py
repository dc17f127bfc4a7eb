"""One rank of an engine: its share of the model, its KV cache and its runner.

A one-rank engine holds its only rank in the engine's process (``UniProcExecutor``). A parallel engine
holds rank 0 there too and one worker process per other rank (``MultiProcExecutor``). Every executor
drives its ranks through the same calls: load, plan, allocate, then execute / apply_block_ops every step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvpilot.engine.memory import KVPoolPlan, num_cpu_swap_blocks
from kvpilot.engine.model_runner import ModelRunner
from kvpilot.engine.models.layers import SingleRankComm
from kvpilot.engine.models.loader import load_model
from kvpilot.engine.outputs import ModelRunnerOutput
from kvpilot.engine.parallel.layout import ParallelLayout
from kvpilot.engine.sampler import Sampler
from kvpilot.engine.scheduler_output import SchedulerOutput
from kvpilot.kernels.backend import get_backend

if TYPE_CHECKING:
    from kvpilot.engine.engine_config import EngineConfig
    from kvpilot.engine.parallel.comm import CommSpec


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to build itself (picklable: sent to every worker). A rank of a CUDA
    engine uses ``cuda:rank``."""

    config: EngineConfig
    comm: CommSpec | None  # None for a one-rank engine
    attention_backend: str  # the driver's resolved choice

    @property
    def layout(self) -> ParallelLayout:
        return self.config.parallel_layout

    @property
    def device_type(self) -> str:
        return self.config.device.type


@dataclass(frozen=True)
class RankReport:
    """What a rank holds, reported to the driver at start-up."""

    rank: int
    pid: int
    description: str  # ParallelLayout.describe(rank)
    weight_bytes: int
    kv_bytes_per_block: int


class Rank:
    """Loads the rank's share of the model from the checkpoint and runs it. ``store`` is the driver's
    own rendezvous store (rank 0 of a parallel engine only); ``device`` overrides the rank's default
    device (``cuda:rank`` or the CPU)."""

    def __init__(self, spec: RankSpec, rank: int, store=None, device: torch.device | None = None) -> None:
        self.spec = spec
        self.shard = spec.layout.shard(rank)
        if device is None:
            device = (
                torch.device(spec.device_type, rank) if spec.device_type == "cuda" else torch.device("cpu")
            )
        self.device = device
        if spec.layout.is_parallel:
            from kvpilot.engine.parallel.comm import ParallelComm  # torch.distributed, only when parallel

            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            self.comm = ParallelComm(spec.comm, spec.layout, self.shard, self.device, store)
        else:
            self.comm = SingleRankComm()
        self.runner: ModelRunner | None = None
        self.plan: KVPoolPlan | None = None

    def load(self) -> RankReport:
        """Load this rank's share of the model and build its runner (a sampler on the sampling rank
        only)."""
        config = self.spec.config
        backend = get_backend(self.spec.attention_backend, config.device.type)
        torch.manual_seed(config.seed)
        model = load_model(
            config.model_dir,
            config.model_config,
            backend,
            config.dtype,
            self.device,
            max(config.max_model_len, 1),
            self.shard,
            self.comm,
        )
        sampler = Sampler(config.seed, self.device) if self.shard.is_sampler else None
        self.runner = ModelRunner(
            model,
            backend,
            self.device,
            config.cache.block_size,
            sampler,
            kv_cache_dtype=config.kv_cache_dtype,
            num_micro_batches=config.pipeline_micro_batches,
        )
        return self.report()

    def report(self) -> RankReport:
        """What this rank holds (for the start-up log and the driver's checks)."""
        return RankReport(
            rank=self.shard.rank,
            pid=os.getpid(),
            description=self.spec.layout.describe(self.shard.rank),
            weight_bytes=self.runner.weight_bytes,
            kv_bytes_per_block=self.runner.kv_bytes_per_block,
        )

    def plan_kv(self) -> KVPoolPlan:
        """This rank's own KV plan (a parallel driver then takes the smallest number of blocks of all
        ranks)."""
        config = self.spec.config
        self.plan = self.runner.size_kv_pool(config.cache, config.scheduler)
        return self.plan

    def num_cpu_blocks(self) -> int:
        """Blocks of the CPU swap pool this rank can hold (``swap_space`` GiB per rank, swap mode)."""
        config = self.spec.config
        return num_cpu_swap_blocks(
            config.scheduler.preemption_mode, config.cache.swap_space_gib, self.runner.kv_bytes_per_block
        )

    def allocate(self, num_blocks: int, num_cpu_blocks: int) -> None:
        """Allocate this rank's KV cache (its layers and KV heads) and CPU swap pool."""
        self.runner.allocate_kv_cache(num_blocks, num_cpu_blocks)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step over this rank's share; the sampled tokens on the sampling rank, else None."""
        return self.runner.execute(out)

    def apply_block_ops(self, out: SchedulerOutput) -> None:
        """Swap out, copy, swap in on this rank's KV cache (a step where nothing runs)."""
        self.runner.apply_block_ops(out)

    def abort(self) -> None:
        """Abort the process groups (unblocks NCCL operations waiting on a dead peer)."""
        if not isinstance(self.comm, SingleRankComm):
            self.comm.abort()
