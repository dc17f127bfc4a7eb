"""Which engine a pod runs (``spec.runtime``), and what upstream vLLM accepts of ``spec.engine``.

The operator's remediation levers are engine arguments that both runtimes share (the KV pool's
memory fraction, ``maxNumSeqs``, the token budget, tensor/pipeline parallelism), so one spec drives
either engine. This module names the ``spec.engine`` keys vLLM has a flag for and those it has no
equivalent for, so validation rejects the latter instead of dropping them; ``render.vllm`` renders
the command line.

Checked against vLLM 0.32's own argument parser (``tests/operator/test_vllm_args.py`` parses every
rendered command with it): vLLM V1 has no ``--preemption-mode``, ``--swap-space`` or ``--device``.
"""

from __future__ import annotations

from typing import Any

# The two runtimes ``spec.runtime`` may name.
RUNTIME_KVPILOT = "kvpilot"
RUNTIME_VLLM = "vllm"
RUNTIMES = (RUNTIME_KVPILOT, RUNTIME_VLLM)

# spec.engine key -> vLLM flag. Booleans render as --flag / --no-flag, as vLLM's parser expects.
VLLM_FLAGS: dict[str, str] = {
    "blockSize": "--block-size",
    "gpuMemoryUtilization": "--gpu-memory-utilization",
    "kvCacheMemoryBytes": "--kv-cache-memory-bytes",
    "numGpuBlocksOverride": "--num-gpu-blocks-override",
    "maxNumSeqs": "--max-num-seqs",
    "maxNumBatchedTokens": "--max-num-batched-tokens",
    "maxModelLen": "--max-model-len",
    "enableChunkedPrefill": "--enable-chunked-prefill",
    "enablePrefixCaching": "--enable-prefix-caching",
    "tensorParallelSize": "--tensor-parallel-size",
    "pipelineParallelSize": "--pipeline-parallel-size",
    "dtype": "--dtype",
    "kvCacheDtype": "--kv-cache-dtype",
    "seed": "--seed",
}

# Values of rendered keys that vLLM's parser refuses, with the reason a user reads.
VLLM_REFUSED_VALUES: dict[str, tuple[frozenset, str]] = {
    "kvCacheDtype": (
        frozenset({"float32"}),
        "vLLM's KV cache types are auto, float16, bfloat16 and fp8 formats (no float32)",
    ),
}

# spec.engine keys vLLM has no equivalent for, with the reason a user reads in the SpecValid message.
# A key listed here is rejected when set to anything but the value vLLM behaves as anyway.
KVPILOT_ONLY: dict[str, tuple[Any, str]] = {
    "preemptionMode": ("recompute", "vLLM V1 only recomputes preempted requests (no swap preemption)"),
    "swapSpace": (None, "vLLM V1 has no CPU swap pool"),
    "pipelineMicroBatches": (None, "vLLM schedules pipeline micro-batches itself"),
    "distributedTimeoutS": (None, "vLLM has no such setting"),
    "device": ("auto", "vLLM picks the device from the build it runs (set the image instead)"),
    "attentionBackend": ("auto", "vLLM chooses its attention backend itself"),
}


# Rendered from other keys rather than passed through (see :func:`cpu_kv_cache_bytes`).
DERIVED = frozenset({"cpuMemoryBudgetBytes"})

# kvpilot's default memory fraction (vLLM's is the same, 0.9).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def cpu_kv_cache_bytes(engine: dict[str, Any]) -> int | None:
    """The KV pool vLLM's CPU backend gets for ``cpuMemoryBudgetBytes``, or None when it is unset.

    vLLM's CPU worker reads ``--gpu-memory-utilization`` as a fraction of the whole node's memory,
    which a pod's memory limit does not bound. With ``cpuMemoryBudgetBytes`` set, the operator renders
    the KV pool explicitly instead: ``gpuMemoryUtilization x cpuMemoryBudgetBytes`` bytes, all of it KV
    cache (the weights live outside the budget), so the memory-fraction lever still sizes the pool.
    An explicit ``kvCacheMemoryBytes`` wins, as it does on kvpilot.
    """
    budget = engine.get("cpuMemoryBudgetBytes")
    if budget is None or engine.get("kvCacheMemoryBytes") is not None:
        return None
    fraction = float(engine.get("gpuMemoryUtilization") or DEFAULT_GPU_MEMORY_UTILIZATION)
    return int(fraction * int(budget))


def unsupported_engine_keys(engine: dict[str, Any]) -> list[str]:
    """One message per ``spec.engine`` key that runtime ``vllm`` cannot honour (empty: all can be)."""
    problems = []
    for key, value in engine.items():
        if key in VLLM_REFUSED_VALUES and value in VLLM_REFUSED_VALUES[key][0]:
            problems.append(
                f"spec.engine.{key} {value} is not supported by runtime vllm: {VLLM_REFUSED_VALUES[key][1]}"
            )
            continue
        if key in VLLM_FLAGS or key in DERIVED:
            continue
        if key in KVPILOT_ONLY:
            neutral, why = KVPILOT_ONLY[key]
            if value is None or value == neutral:
                continue
            problems.append(f"spec.engine.{key} is not supported by runtime vllm: {why}")
        else:
            problems.append(f"spec.engine.{key} is not supported by runtime vllm")
    return problems
