"""The engine's settings, resolved once at start-up from ``EngineArgs``, the checkpoint and the tokenizer.

``resolve`` applies every default and cross-check (device, dtype, parallel layout, ``max_model_len``,
the token budget, the EOS id, the CPU thread count) in one place; the engine and its parts (the
scheduler, the executor and every rank) read the resulting frozen ``EngineConfig`` and never the raw
arguments, nor re-apply a default. Resolving changes nothing in the
process: the engine applies the thread count when it starts (``cpu_threads.apply_num_threads``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvpilot.engine.config import EngineArgs
from kvpilot.engine.cpu_threads import resolve_num_threads
from kvpilot.engine.errors import ConfigError
from kvpilot.engine.models.config import ModelConfig
from kvpilot.engine.parallel import ParallelLayout, validate_parallel_sizes
from kvpilot.engine.scheduler_output import SchedulerConfig

logger = logging.getLogger("kvpilot.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


@dataclass(frozen=True)
class CacheConfig:
    """How the KV pool is sized and used: the block size, prefix caching, the memory it may take (one
    of an explicit block count, an explicit size, or a fraction of the budget) and the swap pool."""

    block_size: int
    enable_prefix_caching: bool
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int | None
    num_gpu_blocks_override: int | None
    cpu_memory_budget_bytes: int | None  # on CPU: what gpu_memory_utilization is a fraction of
    swap_space_gib: float  # CPU memory for swapped-out blocks, per rank (swap preemption)

    @property
    def is_sized_explicitly(self) -> bool:
        """The pool's size is given (no profiling)."""
        return self.num_gpu_blocks_override is not None or self.kv_cache_memory_bytes is not None


@dataclass(frozen=True)
class EngineConfig:
    """What one engine instance runs with, every default applied and every cross-check passed: made
    once from ``EngineArgs`` (``resolve``) and the only configuration the engine's parts read (the
    ranks of a parallel engine get it pickled)."""

    model_dir: str  # the checkpoint's local directory
    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype  # weights and activations (the compute type)
    kv_cache_dtype: torch.dtype  # what the KV pool stores (may be narrower than ``dtype`` on CPU)
    dtype_reason: str  # why these two, for the start-up line
    parallel_layout: ParallelLayout
    pipeline_micro_batches: int  # 1 without pipeline parallelism
    distributed_timeout_s: float
    scheduler: SchedulerConfig  # the start-up values; the scheduler holds the live ones
    cache: CacheConfig
    attention_backend: str  # as requested ("auto" included); ``kernels.backend.get_backend`` decides
    seed: int
    eos_token_id: int | None  # None: the model has no EOS, requests stop on length or stop tokens only
    num_threads: int = 0  # torch intra-op threads the engine runs with on CPU (0: not managed, CUDA)
    threads_reason: str = ""  # where that count came from, for the start-up line

    @property
    def max_model_len(self) -> int:
        """Prompt + output tokens of one request."""
        return self.scheduler.max_model_len

    @property
    def max_num_batched_tokens(self) -> int:
        """The token budget of one step."""
        return self.scheduler.max_num_batched_tokens


def resolve(args: EngineArgs, model_dir: str, model_config: ModelConfig, tokenizer) -> EngineConfig:
    """Resolve ``args`` against the checkpoint in ``model_dir`` and the tokenizer.

    Raises ``ConfigError`` for a device that is not there, parallel sizes the model or the machine
    cannot take, a ``max_model_len`` beyond the model's context, or (without chunked prefill) a token
    budget that cannot hold one whole prompt.
    """
    device = resolve_device(args.device)
    layout = validate_parallel_sizes(
        model_config,
        args.tensor_parallel_size,
        args.pipeline_parallel_size,
        device.type,
        torch.cuda.device_count() if device.type == "cuda" else 0,
    )
    choice = resolve_dtype(args.dtype, model_config, device, args.kv_cache_dtype)
    max_model_len = resolve_max_model_len(args.max_model_len, model_config)
    num_threads, threads_reason = resolve_num_threads() if device.type == "cpu" else (0, "")
    return EngineConfig(
        model_dir=model_dir,
        model_config=model_config,
        device=device,
        dtype=choice.dtype,
        kv_cache_dtype=choice.kv_cache_dtype,
        dtype_reason=choice.reason,
        parallel_layout=layout,
        pipeline_micro_batches=args.pipeline_micro_batches if layout.pipeline_parallel_size > 1 else 1,
        distributed_timeout_s=args.distributed_timeout_s,
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=resolve_max_num_batched_tokens(args, max_model_len),
            max_model_len=max_model_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
            preemption_mode=args.preemption_mode,
        ),
        cache=CacheConfig(
            block_size=args.block_size,
            enable_prefix_caching=args.enable_prefix_caching,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            cpu_memory_budget_bytes=args.cpu_memory_budget_bytes,
            swap_space_gib=args.swap_space,
        ),
        attention_backend=args.attention_backend,
        seed=args.seed,
        eos_token_id=resolve_eos_token_id(tokenizer, model_config),
        num_threads=num_threads,
        threads_reason=threads_reason,
    )


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when visible, else cpu. Raises ``ConfigError`` for cuda without a device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is visible")
    return torch.device(name)


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    reason: str


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_dtype(
    name: str,
    model_config: ModelConfig,
    device: torch.device,
    kv_cache_dtype: str = "auto",
    native_bf16: bool | None = None,
) -> DtypeChoice:
    """The compute type and the KV pool's type, and why.

    ``dtype`` ``auto``: the checkpoint's dtype (float32 when it names none), except on CPU:
    float16 becomes bfloat16 (the same size, a wider range; CPU float16 matmuls are slow), and a
    half-precision checkpoint computes in float32 on a CPU without native bfloat16 (AVX-512 BF16 or
    AMX; ``native_bf16`` defaults to ``kernels.isa.native_bf16()``), where every bfloat16 matmul would
    be emulated at several times the cost of float32. An explicit ``dtype`` always wins.

    ``kv_cache_dtype`` ``auto``: where ``auto`` chose float32 on CPU for lack of native bfloat16, the
    pool keeps the checkpoint's half-precision type, so that it holds as many blocks as it would in
    bfloat16 (the kernels widen K/V to float32 as they read them, a shift per element); else the
    compute type. An explicit type is taken as given, on CPU only (the CUDA kernels read the
    compute type).
    """
    if name != "auto":
        dtype, reason = _DTYPES[name], f"dtype {name} (as set)"
        half_checkpoint = None
    else:
        dtype = _DTYPES.get(str(model_config.torch_dtype), torch.float32)
        reason = f"dtype auto: the checkpoint's {_name(dtype)}"
        if device.type == "cpu" and dtype == torch.float16:
            dtype = torch.bfloat16
            reason += " as bfloat16 on CPU (float16 matmuls are slow on CPUs)"
        half_checkpoint = dtype if dtype != torch.float32 else None
        if device.type == "cpu" and dtype == torch.bfloat16:
            if native_bf16 is None:
                from kvpilot.kernels import isa

                native_bf16 = isa.native_bf16()
            if native_bf16:
                reason += "; this CPU has native bfloat16 (AVX-512 BF16 or AMX)"
                half_checkpoint = None
            else:
                dtype = torch.float32
                reason += (
                    ", computed in float32: this CPU has no native bfloat16 (AVX-512 BF16 or AMX), where "
                    "bfloat16 matmuls would be emulated"
                )
        else:
            half_checkpoint = None
    if kv_cache_dtype != "auto":
        kv = _DTYPES[kv_cache_dtype]
        if kv != dtype and device.type != "cpu":
            raise ConfigError(
                f"kv_cache_dtype {kv_cache_dtype} differs from dtype {_name(dtype)}: a KV cache of another "
                "type is supported on CPU only"
            )
        if kv != dtype and dtype != torch.float32:
            raise ConfigError(
                f"kv_cache_dtype {kv_cache_dtype} with dtype {_name(dtype)}: a KV cache of another type "
                "than the compute type needs float32 compute"
            )
        kv_reason = f"KV cache {kv_cache_dtype} (as set)"
    elif half_checkpoint is not None:
        kv = half_checkpoint
        kv_reason = f"KV cache kept in {_name(kv)} (as many blocks per GiB as the checkpoint's type)"
    else:
        kv = dtype
        kv_reason = f"KV cache {_name(kv)}"
    return DtypeChoice(dtype, kv, f"{reason}; {kv_reason}")


def resolve_max_model_len(requested: int | None, model_config: ModelConfig) -> int:
    """The model's context (its sliding window when smaller), or ``requested`` within it."""
    limit = model_config.max_position_embeddings
    if model_config.sliding_window is not None and model_config.sliding_window < limit:
        logger.info("sliding window %d: max_model_len limited to it", model_config.sliding_window)
        limit = model_config.sliding_window
    if requested is None:
        return limit
    if requested > limit:
        raise ConfigError(f"max_model_len {requested} exceeds what the model supports ({limit})")
    return requested


def resolve_max_num_batched_tokens(args: EngineArgs, max_model_len: int) -> int:
    """The step's token budget: ``args.max_num_batched_tokens``, by default 8192 (at least
    ``max_num_seqs``, and at least ``max_model_len`` without chunked prefill)."""
    max_batched = args.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, args.max_num_seqs)
    if args.enable_chunked_prefill:
        return max_batched
    if args.max_num_batched_tokens is None:
        max_batched = max(max_batched, max_model_len)
    if max_batched < max_model_len:
        raise ConfigError(
            f"without chunked prefill max_num_batched_tokens ({max_batched}) must be >= max_model_len "
            f"({max_model_len}); enable chunked prefill or raise it"
        )
    return max_batched


def resolve_eos_token_id(tokenizer, model_config: ModelConfig) -> int | None:
    """The tokenizer's EOS id, else the checkpoint's first one, else None."""
    if tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    return model_config.eos_token_ids[0] if model_config.eos_token_ids else None
