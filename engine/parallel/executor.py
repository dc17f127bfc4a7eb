"""Executors: how ``LLMEngine`` runs the model -- in its own process, or over parallel ranks.

An ``Executor`` loads the model, sizes and allocates the KV cache, and runs each step's
``SchedulerOutput``. Both drive ``Rank``s (``rank``): ``UniProcExecutor`` holds the only one in the
engine's process; ``MultiProcExecutor`` (``multiproc``) holds rank 0 there and one worker process per
other rank.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvpilot.engine.memory import KVPoolPlan
from kvpilot.engine.model_runner import ModelRunner
from kvpilot.engine.outputs import ModelRunnerOutput
from kvpilot.engine.parallel.layout import ParallelLayout
from kvpilot.engine.parallel.rank import Rank, RankSpec
from kvpilot.engine.scheduler_output import SchedulerOutput
from kvpilot.kernels.backend import AttentionBackend

if TYPE_CHECKING:
    from kvpilot.engine.engine_config import EngineConfig
    from kvpilot.engine.parallel.comm import CommSpec


@dataclass(frozen=True)
class ExecutorSpec:
    """What the engine resolved before building its executor: its configuration and the attention
    backend it chose (its name travels to the other ranks)."""

    config: EngineConfig
    backend: AttentionBackend

    @property
    def layout(self) -> ParallelLayout:
        return self.config.parallel_layout

    @property
    def device(self) -> torch.device:
        return self.config.device

    def rank_spec(self, comm: CommSpec | None = None) -> RankSpec:
        """What every rank of this engine builds itself from (``comm``: None for one rank)."""
        return RankSpec(config=self.config, comm=comm, attention_backend=self.backend.name)


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


class UniProcExecutor(Executor):
    """The whole model in the engine's process: its one ``Rank``."""

    def __init__(self, spec: ExecutorSpec) -> None:
        self.rank = Rank(spec.rank_spec(), 0, device=spec.device)
        self.rank.load()
        self.runner = self.rank.runner
        self.kv_plan = self.rank.plan_kv()
        self.num_cpu_blocks = self.rank.num_cpu_blocks()
        self.rank.allocate(self.kv_plan.num_blocks, self.num_cpu_blocks)

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
