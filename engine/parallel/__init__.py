"""Tensor and pipeline parallelism: the layout of ranks, the ranks, and the executors.

Modules:

* ``layout``: how a model splits over tensor-parallel ranks and pipeline stages (torch-free; the
  operator imports it to choose valid sizes).
* ``comm``: the process groups of one rank (all-reduce, gather, stage-to-stage send/recv).
* ``rank``: one rank's model share, KV cache and runner, built the same way at every size.
* ``executor``: the ``Executor`` interface, its one-process implementation and ``create_executor``.
* ``multiproc``: the driver of a parallel engine (rank 0 here, one worker process per other rank).
* ``supervision``: how the driver watches its worker processes (exits, reported errors, reaping).
* ``worker``: the worker process's loop and its pipe protocol.

The names below load lazily, so importing this package does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ParallelLayout": "kvpilot.engine.parallel.layout",
    "RankShard": "kvpilot.engine.parallel.layout",
    "allowed_tensor_parallel_sizes": "kvpilot.engine.parallel.layout",
    "validate_parallel_sizes": "kvpilot.engine.parallel.layout",
    "Executor": "kvpilot.engine.parallel.executor",
    "ExecutorSpec": "kvpilot.engine.parallel.executor",
    "MultiProcExecutor": "kvpilot.engine.parallel.multiproc",
    "UniProcExecutor": "kvpilot.engine.parallel.executor",
    "WorkerDiedError": "kvpilot.engine.errors",
    "create_executor": "kvpilot.engine.parallel.executor",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpilot.engine.parallel' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
