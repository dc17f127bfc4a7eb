"""The collectives one rank needs: all-reduce and gather in its tensor-parallel group, and send/recv of
activations to the neighbouring pipeline stages.

Process groups are built directly on a ``TCPStore`` that the driver serves on 127.0.0.1 (port chosen
by the OS): no ``init_process_group``, so no process-global state, and several engines can live in one
process one after the other (tests do). Gloo on CPU binds to the loopback interface only; NCCL on CUDA.

Every operation has a timeout (the ``distributed_timeout_s`` engine argument): a peer that hangs makes the
others raise instead of waiting forever. A peer that dies is noticed at once on gloo (its sockets close:
"Connection closed by peer"); the driver's watchdog aborts NCCL groups when a worker process exits.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvpilot.engine.parallel.layout import ParallelLayout, RankShard

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class CommSpec:
    """How a rank reaches the others (picklable; sent to every worker)."""

    port: int  # the driver's TCPStore on 127.0.0.1
    world_size: int
    backend: str  # "gloo" | "nccl"
    timeout_s: float  # of every collective and of the rendezvous


def serve_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store, served by the driver on a free loopback port (``store.port``)."""
    return dist.TCPStore(
        LOOPBACK,
        0,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


class ParallelComm:
    """The process groups of one rank (a ``kvpilot.engine.models.layers.Comm``). ``store`` is the
    driver's own store (rank 0) or None (connect)."""

    def __init__(
        self,
        spec: CommSpec,
        layout: ParallelLayout,
        shard: RankShard,
        device: torch.device,
        store: dist.Store | None = None,
    ) -> None:
        self.spec = spec
        self.layout = layout
        self.shard = shard
        self.device = device
        self.tp_size = layout.tensor_parallel_size
        self.tp_rank = shard.tp_rank
        timeout = datetime.timedelta(seconds=spec.timeout_s)
        if store is None:
            store = dist.TCPStore(LOOPBACK, spec.port, spec.world_size, is_master=False, timeout=timeout)
        self._store = store
        # The whole world carries stage-to-stage sends; each stage's tensor-parallel ranks reduce together.
        self.world = self._group("world", shard.rank, spec.world_size)
        self.tp_group = None
        if self.tp_size > 1:
            self.tp_group = self._group(f"tp{shard.pp_rank}", shard.tp_rank, self.tp_size)

    def _group(self, name: str, rank: int, size: int):
        store = dist.PrefixStore(name, self._store)
        timeout = datetime.timedelta(seconds=self.spec.timeout_s)
        if self.spec.backend == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            return dist.ProcessGroupNCCL(store, rank, size, opts)
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
        opts._timeout = timeout
        return dist.ProcessGroupGloo(store, rank, size, opts)

    # ------------------------------------------------------------------ tensor parallel
    def tp_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the tensor-parallel group, in place; returns ``x``."""
        if self.tp_group is not None:
            self.tp_group.allreduce([x]).wait()
        return x

    def tp_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every tensor-parallel rank's ``x`` along the last dimension, on tp rank 0 (the
        others get None)."""
        if self.tp_group is None:
            return x
        x = x.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.shard.tp_rank == 0:
            parts = [torch.empty_like(x) for _ in range(self.tp_size)]
            self.tp_group.gather([parts], [x], opts).wait()
            return torch.cat(parts, dim=-1)
        self.tp_group.gather([], [x], opts).wait()
        return None

    # ------------------------------------------------------------------ pipeline parallel
    def send_to_next_stage(self, x: torch.Tensor) -> None:
        """Send activations to the same tensor-parallel rank of the next stage."""
        self.world.send([x.contiguous()], self.shard.rank + self.tp_size, 0).wait()

    def recv_from_prev_stage(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Receive activations of ``shape`` from the same tensor-parallel rank of the previous stage."""
        x = torch.empty(shape, dtype=dtype, device=self.device)
        self.world.recv([x], self.shard.rank - self.tp_size, 0).wait()
        return x

    def abort(self) -> None:
        """Abort the groups so that operations blocked on a dead peer return (NCCL); best effort."""
        for group in (self.tp_group, self.world):
            if group is None:
                continue
            try:
                group.abort()
            except Exception:  # aborting is a last resort: the caller raises anyway
                pass
