"""Executors: how ``LLMEngine`` runs the model -- in its own process, or over parallel ranks.

An ``Executor`` loads the model, sizes and allocates the KV cache, and runs each step's
``SchedulerOutput``. ``UniProcExecutor`` wraps one ``ModelRunner`` in the engine's process;
``MultiProcExecutor`` (``multiproc``) runs rank 0 there and one worker process per other rank.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kvpilot.engine.config import EngineArgs
from kvpilot.engine.errors import WorkerDiedError  # noqa: F401 (re-exported)
from kvpilot.engine.memory import GiB, KVPoolPlan
from kvpilot.engine.model_runner import ModelRunner
from kvpilot.engine.models.config import ModelConfig
from kvpilot.engine.models.loader import load_model
from kvpilot.engine.outputs import ModelRunnerOutput
from kvpilot.engine.parallel.layout import ParallelLayout
from kvpilot.engine.parallel.runner import plan_rank_kv_pool
from kvpilot.engine.sampler import Sampler
from kvpilot.engine.scheduler import SchedulerOutput
from kvpilot.kernels import AttentionBackend


@dataclass(frozen=True)
class ExecutorSpec:
    """What the engine resolved before building its executor."""

    model_dir: str
    model_config: ModelConfig
    args: EngineArgs
    layout: ParallelLayout
    dtype: torch.dtype
    device: torch.device
    backend: AttentionBackend
    max_model_len: int
    max_num_batched_tokens: int


class Executor(ABC):
    """Runs the model for ``LLMEngine``: loads it, sizes and allocates the KV cache, executes steps.

    ``runner`` is the driver process's own runner (rank 0), ``kv_plan`` its KV plan (with the number of
    blocks every rank holds) and ``num_cpu_blocks`` the size of the swap pool (blocks, on every rank).
    """

    runner: ModelRunner
    kv_plan: KVPoolPlan
    num_cpu_blocks: int

    @abstractmethod
    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """Block operations, one forward over the scheduled tokens, sampling; the sampled tokens."""

    @abstractmethod
    def apply_block_ops(self, sched_out: SchedulerOutput) -> None:
        """Only the block operations of ``sched_out`` (a step where nothing runs)."""

    @abstractmethod
    def check_health(self) -> None:
        """Raise the error that makes this executor unusable, if any."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop any worker process (idempotent)."""


def _cpu_swap_blocks(args: EngineArgs, bytes_per_block: int) -> int:
    # The CPU swap pool exists only in swap mode: swap_space GiB of host memory (per rank).
    return int(args.swap_space * GiB) // bytes_per_block if args.preemption_mode == "swap" else 0


class UniProcExecutor(Executor):
    """The whole model in the engine's process."""

    def __init__(self, spec: ExecutorSpec) -> None:
        cfg, args = spec.model_config, spec.args
        model = load_model(
            spec.model_dir, cfg, spec.backend, spec.dtype, spec.device, max(spec.max_model_len, 1)
        )
        sampler = Sampler(args.seed, spec.device)
        self.runner = ModelRunner(model, spec.backend, spec.device, args.block_size, sampler)
        self.kv_plan = plan_rank_kv_pool(
            self.runner,
            cfg,
            args,
            spec.dtype,
            spec.device,
            spec.max_model_len,
            spec.max_num_batched_tokens,
            cfg.vocab_size,
        )
        self.num_cpu_blocks = _cpu_swap_blocks(args, self.kv_plan.bytes_per_block)
        self.runner.allocate_kv_cache(self.kv_plan.num_blocks, self.num_cpu_blocks)

    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute(sched_out)

    def apply_block_ops(self, sched_out: SchedulerOutput) -> None:
        self.runner.apply_block_ops(sched_out)

    def check_health(self) -> None:
        return None  # nothing runs outside this process

    def shutdown(self) -> None:
        return None


def create_executor(spec: ExecutorSpec) -> Executor:
    """One process for a 1 x 1 layout, else a driver rank plus worker processes."""
    if spec.layout.is_parallel:
        from kvpilot.engine.parallel.multiproc import MultiProcExecutor  # it imports this module

        return MultiProcExecutor(spec)
    return UniProcExecutor(spec)
