"""Paged-attention and KV-cache kernels behind one interface.

``get_backend(name, device)`` returns an ``AttentionBackend`` whose ops all have the signatures of
``kvpilot.kernels.torch_ops``. The backend is chosen once, at engine start-up, from the
``attention_backend`` engine argument.

Modules:

* ``metadata``: ``AttentionMetadata``, the per-step tensors every backend reads.
* ``torch_ops``: the pure-torch ops, the reference for the Triton kernels and the CPU path.
* ``triton_ops``: the Triton kernels with the same signatures (compiled on CUDA, interpreted on CPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvpilot.kernels.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend", "resolve_backend_name"]

BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class AttentionBackend:
    """The ops of one backend (see ``torch_ops`` for their contracts)."""

    name: str
    write_kv_cache: Callable
    paged_attention: Callable
    copy_blocks: Callable
    swap_blocks: Callable


def resolve_backend_name(name: str, device_type: str) -> str:
    """``auto`` -> ``triton`` on CUDA when triton imports, else ``torch``; an explicit name as is.
    Raises ``ValueError`` for an unknown name."""
    if name == "auto":
        if device_type == "cuda":
            try:
                import triton  # noqa: F401

                return "triton"
            except ImportError:
                return "torch"
        return "torch"
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of auto, {', '.join(BACKENDS)}; got {name!r}")
    return name


def get_backend(name: str = "auto", device_type: str = "cpu") -> AttentionBackend:
    name = resolve_backend_name(name, device_type)
    if name == "triton":
        from kvpilot.kernels import triton_ops as ops
    else:
        from kvpilot.kernels import torch_ops as ops
    return AttentionBackend(
        name=name,
        write_kv_cache=ops.write_kv_cache,
        paged_attention=ops.paged_attention,
        copy_blocks=ops.copy_blocks,
        swap_blocks=ops.swap_blocks,
    )
