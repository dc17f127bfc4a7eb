"""Engine arguments: one dataclass whose fields are the CLI flags and the CRD's ``spec.engine`` keys.

This module imports nothing heavier than the standard library: the operator reads the field names,
defaults and flag spellings from here without pulling in torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from kvpilot.engine.errors import ConfigError  # noqa: F401 (re-exported)

PREEMPTION_MODES = ("recompute", "swap")
DEVICES = ("auto", "cuda", "cpu")
DTYPES = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "cpu")


def _arg(default: Any, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class EngineArgs:
    """Everything that configures one engine instance.

    Field name = keyword of ``LLM(...)`` = ``--kebab-case`` flag of ``kvpilot serve`` =
    camelCase key under the InferenceService's ``spec.engine``.
    """

    model: str = _arg("", "Path to a local Hugging Face model directory.", cli=False)
    tokenizer: str | None = _arg(None, "Tokenizer directory (defaults to the model directory).")
    block_size: int = _arg(16, "Tokens per KV-cache block.")
    gpu_memory_utilization: float = _arg(
        0.9, "Fraction of device memory the engine may use (weights + activations + KV cache)."
    )
    kv_cache_memory_bytes: int | None = _arg(None, "Explicit KV-cache size in bytes (skips profiling).")
    num_gpu_blocks_override: int | None = _arg(None, "Explicit number of KV-cache blocks (skips profiling).")
    cpu_memory_budget_bytes: int | None = _arg(
        None, "On CPU: the process memory budget that gpu_memory_utilization is a fraction of (default: RAM)."
    )
    max_num_seqs: int = _arg(256, "Maximum number of sequences running in one step.")
    max_num_batched_tokens: int | None = _arg(
        None, "Token budget of one step (default 8192, at least max_model_len without chunked prefill)."
    )
    max_model_len: int | None = _arg(None, "Maximum prompt + output length (default: the model's context).")
    enable_chunked_prefill: bool = _arg(True, "Split long prompts across steps to fill the token budget.")
    enable_prefix_caching: bool = _arg(True, "Reuse KV blocks of identical prompt prefixes.")
    preemption_mode: str = _arg("recompute", "What preemption does with a victim's KV: recompute | swap.")
    swap_space: float = _arg(4.0, "GiB of CPU memory for swapped-out KV blocks (swap preemption).")
    tensor_parallel_size: int = _arg(1, "Number of tensor-parallel ranks.")
    pipeline_parallel_size: int = _arg(1, "Number of pipeline stages.")
    pipeline_micro_batches: int = _arg(
        1, "Micro-batches a step is split into so that pipeline stages overlap (1: no split)."
    )
    distributed_timeout_s: float = _arg(
        300.0, "Seconds a collective between parallel ranks may wait before it fails."
    )
    dtype: str = _arg(
        "auto",
        "Weight and activation dtype: auto | float32 | bfloat16 | float16 (auto: the checkpoint's, in "
        "float32 on a CPU without native bfloat16).",
    )
    kv_cache_dtype: str = _arg(
        "auto",
        "KV cache storage dtype: auto | float32 | bfloat16 | float16 (auto: the compute dtype, or the "
        "checkpoint's half type where auto computes in float32 on CPU). Another type than dtype: CPU, "
        "float32 compute only.",
    )
    device: str = _arg("auto", "cuda | cpu | auto (cuda when available).")
    attention_backend: str = _arg(
        "auto", "Attention kernels: auto | torch | triton | cpu (the C++ kernel for CPU devices)."
    )
    seed: int = _arg(0, "Seed of the engine's default random generator.")

    def __post_init__(self) -> None:
        def positive(name: str, allow_none: bool = False) -> None:
            value = getattr(self, name)
            if value is None and allow_none:
                return
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")

        positive("block_size")
        positive("max_num_seqs")
        positive("max_num_batched_tokens", allow_none=True)
        positive("max_model_len", allow_none=True)
        positive("num_gpu_blocks_override", allow_none=True)
        positive("kv_cache_memory_bytes", allow_none=True)
        positive("cpu_memory_budget_bytes", allow_none=True)
        positive("tensor_parallel_size")
        positive("pipeline_parallel_size")
        positive("pipeline_micro_batches")
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < float(self.gpu_memory_utilization) <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        timeout = self.distributed_timeout_s
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, int | float)
            or not 0 < timeout < float("inf")
        ):
            raise ConfigError(f"distributed_timeout_s must be a positive number of seconds, got {timeout!r}")
        if self.swap_space < 0:
            raise ConfigError(f"swap_space must be >= 0 GiB, got {self.swap_space!r}")
        for name, allowed in (
            ("preemption_mode", PREEMPTION_MODES),
            ("device", DEVICES),
            ("dtype", DTYPES),
            ("kv_cache_dtype", DTYPES),
            ("attention_backend", ATTENTION_BACKENDS),
        ):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")


def engine_arg_fields() -> list[dataclasses.Field]:
    """The engine arguments in declaration order (the single source for flags and CRD keys)."""
    return list(dataclasses.fields(EngineArgs))


def flag_name(field_name: str) -> str:
    """``max_num_seqs`` -> ``--max-num-seqs``."""
    return "--" + field_name.replace("_", "-")


def crd_key(field_name: str) -> str:
    """``max_num_seqs`` -> ``maxNumSeqs``."""
    head, *rest = field_name.split("_")
    return head + "".join(part.capitalize() for part in rest)


def to_cli_args(values: dict[str, Any]) -> list[str]:
    """Render engine arguments as ``kvpilot serve`` flags, in field order.

    ``values`` maps field names (snake_case) to values; ``None`` values are omitted. Booleans render
    as ``--flag`` / ``--no-flag`` (argparse's BooleanOptionalAction), everything else as ``--flag value``.
    The operator's manifest builders and ``kvpilot serve``'s parser both derive from this module, so
    the rendered args always parse.
    """
    known = {f.name for f in engine_arg_fields()}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown engine argument(s): {', '.join(unknown)}")
    args: list[str] = []
    for f in engine_arg_fields():
        if f.name not in values or values[f.name] is None or f.name == "model":
            continue
        value = values[f.name]
        flag = flag_name(f.name)
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        else:
            args.extend([flag, str(value)])
    return args
