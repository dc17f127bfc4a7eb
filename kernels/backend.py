"""Paged-attention and KV-cache kernels behind one interface.

``get_backend(name, device)`` returns an ``AttentionBackend`` whose ops all have the signatures of
``kvpilot.kernels.torch_ops``. The backend is chosen once, at engine start-up, from the
``attention_backend`` engine argument.

``kvpilot.kernels`` is a namespace package (no ``__init__.py``), like ``kvpilot.operator``: the
repository's ``kernels/`` folder must not be a regular package named ``kernels``, which would shadow
the installed distribution of that name (a dependency of transformers) in any process started from
the repository root. Its modules:

* ``backend`` (this one): ``AttentionBackend``, ``get_backend``, ``resolve_backend_name``.
* ``metadata``: ``AttentionMetadata``, the per-step tensors every backend reads.
* ``torch_ops``: the pure-torch ops, the reference for the Triton kernels and the CPU path.
* ``triton_ops``: the Triton kernels with the same signatures (compiled on CUDA, interpreted on CPU).
* ``cpu_ops``: the ``cpu`` backend, a C++ kernel that reads K/V in place (``csrc/``), built and cached
  by ``cpu_build``; the torch cache ops.
* ``isa``: what this CPU can run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

__all__ = ["AttentionBackend", "FusedDecoderOps", "get_backend", "resolve_backend_name"]

BACKENDS = ("torch", "triton", "cpu")


class FusedDecoderOps(Protocol):
    """Fused decoder-layer ops a backend may offer (``cpu_ops.FusedOps``), for the dtypes in
    ``DTYPES``; the model runs its torch ops for any other."""

    DTYPES: tuple

    def rms_norm(self, x, weight, eps: float): ...
    def add_rms_norm_(self, x, residual, weight, eps: float): ...
    def rotary_(self, q, k, cos, sin) -> None: ...
    def silu_and_mul(self, gate_up): ...


@dataclass(frozen=True)
class AttentionBackend:
    """The ops of one backend (see ``torch_ops`` for their contracts) and what it declares about the KV
    pool; the engine asks these, never the backend's name."""

    name: str
    write_kv_cache: Callable
    paged_attention: Callable
    copy_blocks: Callable
    swap_blocks: Callable
    # Fused decoder-layer ops, or None: the model runs its torch ops.
    fused: FusedDecoderOps | None = None
    # The pool's storage order within a layer: False is ``[num_blocks, block_size, num_kv_heads,
    # head_size]``; True stores one contiguous run per (block, KV head), ``[num_blocks, num_kv_heads,
    # block_size, head_size]``, which the ops still see through the first shape's view (by strides).
    head_major_kv: bool = False
    # The ops read masked-out padding slots of a block, which must then hold finite values (a pool
    # allocated zeroed); False: they never read a slot that was not written.
    needs_zeroed_kv: bool = True


def resolve_backend_name(name: str, device_type: str) -> str:
    """``auto`` -> ``triton`` on CUDA when triton imports, ``cpu`` on CPU when the C++ kernel builds (or
    is cached), else ``torch``; an explicit name as is. Raises ``ValueError`` for an unknown name."""
    if name == "auto":
        if device_type == "cuda":
            try:
                import triton  # noqa: F401

                return "triton"
            except ImportError:
                return "torch"
        from kvpilot.kernels import cpu_ops

        return "cpu" if cpu_ops.is_available() else "torch"
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of auto, {', '.join(BACKENDS)}; got {name!r}")
    if name == "cpu" and device_type != "cpu":
        raise ValueError(f"attention backend cpu runs on CPU devices only; got device {device_type!r}")
    return name


def get_backend(name: str = "auto", device_type: str = "cpu") -> AttentionBackend:
    """The ops of backend ``name`` (resolved by ``resolve_backend_name``). ``cpu`` whose kernel cannot
    be built falls back to ``torch`` (the build failure is logged once)."""
    name = resolve_backend_name(name, device_type)
    if name == "cpu":
        from kvpilot.kernels import cpu_ops

        if not cpu_ops.is_available():
            name = "torch"
    if name == "triton":
        from kvpilot.kernels import triton_ops as ops
    elif name == "cpu":
        from kvpilot.kernels import cpu_ops as ops
    else:
        from kvpilot.kernels import torch_ops as ops
    return AttentionBackend(
        name=name,
        write_kv_cache=ops.write_kv_cache,
        paged_attention=ops.paged_attention,
        copy_blocks=ops.copy_blocks,
        swap_blocks=ops.swap_blocks,
        fused=ops.fused_ops() if name == "cpu" else None,
        # The C++ kernels address the pool by its strides: one contiguous run per (block, KV head),
        # which decode attention reads ~10-15% faster (benchmarks/attention_cpu.py); they never read a
        # slot that was not written (tested with NaN in every other slot).
        head_major_kv=name == "cpu",
        needs_zeroed_kv=name != "cpu",
    )
