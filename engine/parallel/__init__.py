"""Tensor and pipeline parallelism: the layout of ranks, the sharded model, and the executors.

``layout`` is torch-free (the operator may import it to choose valid sizes); the other names load
lazily, so importing this package does not import torch.
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
    "WorkerDiedError": "kvpilot.engine.parallel.executor",
    "create_executor": "kvpilot.engine.parallel.executor",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvpilot.engine.parallel' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
