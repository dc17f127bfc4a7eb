"""The engine's settings, resolved once at start-up from ``EngineArgs``, the checkpoint and the tokenizer.

``resolve`` applies every default and cross-check (device, dtype, parallel layout, ``max_model_len``,
the token budget, the EOS id) in one place; the engine and its parts read the resulting frozen
``EngineConfig`` and never re-apply a default.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvpilot.engine.config import EngineArgs
from kvpilot.engine.errors import ConfigError
from kvpilot.engine.models.config import ModelConfig
from kvpilot.engine.parallel import ParallelLayout, validate_parallel_sizes
from kvpilot.engine.scheduler_output import SchedulerConfig

logger = logging.getLogger("kvpilot.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


@dataclass(frozen=True)
class EngineConfig:
    """What one engine instance runs with, every default applied and every cross-check passed."""

    device: torch.device
    dtype: torch.dtype
    parallel_layout: ParallelLayout
    max_model_len: int  # prompt + output tokens of one request
    max_num_batched_tokens: int  # token budget of one step
    eos_token_id: int | None  # None: the model has no EOS, requests stop on length or stop tokens only

    def scheduler_config(self, args: EngineArgs) -> SchedulerConfig:
        """The scheduler's knobs: ``args``' own values plus the resolved lengths."""
        return SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=args.enable_chunked_prefill,
            preemption_mode=args.preemption_mode,
        )


def resolve(args: EngineArgs, model_config: ModelConfig, tokenizer) -> EngineConfig:
    """Resolve ``args`` against the model and the tokenizer.

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
    dtype = resolve_dtype(args.dtype, model_config, device)
    max_model_len = resolve_max_model_len(args.max_model_len, model_config)
    return EngineConfig(
        device=device,
        dtype=dtype,
        parallel_layout=layout,
        max_model_len=max_model_len,
        max_num_batched_tokens=resolve_max_num_batched_tokens(args, max_model_len),
        eos_token_id=resolve_eos_token_id(tokenizer, model_config),
    )


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when visible, else cpu. Raises ``ConfigError`` for cuda without a device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is visible")
    return torch.device(name)


def resolve_dtype(name: str, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    """``auto`` -> the checkpoint's dtype (float32 when it names none), bfloat16 instead of float16 on
    CPU."""
    if name != "auto":
        return _DTYPES[name]
    dtype = _DTYPES.get(str(model_config.torch_dtype), torch.float32)
    if device.type == "cpu" and dtype == torch.float16:
        # float16 matmuls are slow on CPUs; bfloat16 has the same size and a wider range.
        logger.info("dtype float16 -> bfloat16 on CPU")
        dtype = torch.bfloat16
    return dtype


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
