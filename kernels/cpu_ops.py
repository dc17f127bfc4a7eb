"""The ``cpu`` backend: a C++ paged-attention kernel that reads K/V in place, a one-pass KV-cache write,
torch's block copy and swap.

``paged_attention`` has the signature of ``torch_ops.paged_attention``. The kernel walks each
request's block table and reads the blocks where they lie (no gather copy, no padded keys), with an
online softmax in fp32 over the key blocks (a prefill tile steps four blocks of 16 at a time),
parallel over (request, KV head, query tile) on ATen's threads. In bfloat16, decode rows take
AVX512-BF16 dot products on the raw keys, and prefill tiles take AMX tile products where the CPU has
them (``uses_amx()``; P rounded to bfloat16 for the PV product). See
``kernels/csrc/paged_attention_cpu.cpp``.

``fused_ops()`` returns the extension's fused elementwise ops of a decoder layer (add + RMSNorm,
rotary in place, SiLU x up) used for bfloat16 activations, or None where the extension is not
available; they round as the torch ops they replace (see ``kernels/csrc/fused_cpu.cpp``).

``pack_bf16_panels(weight)`` and ``linear_bf16w(x, packed, n)``: the linears of a float32 model whose
weights are bfloat16 values (a bfloat16 checkpoint on a CPU without native bfloat16), float32
activations times bfloat16-stored weights widened in registers (see ``kernels/csrc/linear_cpu.cpp``);
``linear_bf16w_path()`` names the inner loop this build runs.

The extension is compiled on first use (``cpu_build``) and cached on disk; ``is_available()`` says
whether it could be built or loaded, and never raises.
"""

from __future__ import annotations

import torch

from kvpilot.kernels import torch_ops
from kvpilot.kernels.cpu_build import load_extension
from kvpilot.kernels.metadata import AttentionMetadata
from kvpilot.kernels.torch_ops import copy_blocks, swap_blocks

__all__ = [
    "FusedOps",
    "copy_blocks",
    "fused_ops",
    "is_available",
    "linear_bf16w",
    "linear_bf16w_path",
    "pack_bf16_panels",
    "paged_attention",
    "swap_blocks",
    "uses_amx",
    "write_kv_cache",
]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernel_dtypes(compute: torch.dtype, cache: torch.dtype) -> bool:
    """The (activation, cache) dtype pairs the kernels take: one of ``_DTYPES`` for both, or float32
    compute over a half-precision pool."""
    return compute in _DTYPES and (cache == compute or (compute == torch.float32 and cache in _DTYPES))


def uses_amx() -> bool:
    """Whether bfloat16 prefill tiles run on AMX here (the kernel built for it and the OS permits it)."""
    ext = load_extension()
    return bool(ext is not None and ext.uses_amx())


def is_available() -> bool:
    """Whether the C++ kernel is built (or loadable from the cache) in this process."""
    return load_extension() is not None


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``torch_ops.write_kv_cache`` in one pass of the extension (no mask, no host sync per layer)
    where the dtypes match (or float32 rows go to a half-precision pool, rounded as ``.to()`` rounds)
    and the caches are CPU tensors whose head dimension is contiguous (any other
    strides, e.g. the per-(block, head) contiguous pool's permuted views); the torch op otherwise."""
    ext = load_extension()
    if (
        ext is None
        or not _kernel_dtypes(key.dtype, k_cache.dtype)
        or value.dtype != key.dtype
        or v_cache.dtype != k_cache.dtype
        or key.device.type != "cpu"
        or k_cache.device.type != "cpu"
        or v_cache.device.type != "cpu"
        or k_cache.stride(-1) != 1
        or v_cache.stride(-1) != 1
        or key.stride(-1) != 1
        or value.stride(-1) != 1
        or slot_mapping.dtype != torch.int64
    ):
        torch_ops.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
        return
    ext.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each request's query span over all of its cached tokens (see
    ``torch_ops.paged_attention``), computed in place over the block pool.

    ``query: [num_tokens, num_heads, head_size]`` may be a strided view (e.g. of a fused QKV tensor)
    whose last dimension is contiguous; ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
    head_size]``. Returns a contiguous ``[num_tokens, num_heads, head_size]`` tensor in the query's
    dtype. Raises ``ValueError`` for tensors the kernel does not take (not on CPU, unsupported dtype
    pairs, a head count that is not a multiple of the KV heads) and ``RuntimeError`` when the
    extension is not available.
    """
    ext = load_extension()
    if ext is None:
        raise RuntimeError("the CPU attention kernel is not available; use the torch backend")
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    if query.device.type != "cpu" or k_cache.device.type != "cpu" or v_cache.device.type != "cpu":
        raise ValueError("the cpu backend takes CPU tensors only")
    if not _kernel_dtypes(query.dtype, k_cache.dtype) or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            "query and caches must share one of float32, bfloat16, float16, or a float32 query read "
            f"bfloat16 or float16 caches; got {query.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if query.stride(-1) != 1:
        query = query.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the caches' head dimension must be contiguous")
    return ext.paged_attention(
        query,
        k_cache,
        v_cache,
        _int32(metadata.query_start_loc),
        _int32(metadata.seq_lens),
        _int32(metadata.block_tables),
        float(scale),
    )


class FusedOps:
    """The fused decoder-layer ops of the C++ extension, used for bfloat16 and float32 CPU tensors
    (``DTYPES``). In bfloat16 they match the torch ops bit for bit; in float32 they differ from torch's
    only where a sum of squares or an exp rounds differently (within 1e-6, and the float32 engine stays
    token-identical to transformers); float16 differs in the last bit now and then, so it keeps torch's.

    ``rms_norm(x, weight, eps)``: ``weight * half(rms_norm(float(x)))``, ``x: [num_tokens, hidden]``.
    ``add_rms_norm_(x, residual, weight, eps)``: ``residual += x`` in place (rounded to the dtype), then
    ``rms_norm(residual, weight, eps)``. ``rotary_(q, k, cos, sin)``: neox rotary in place on
    ``q: [T, H, D]``, ``k: [T, Hkv, D]`` (last dimension contiguous), ``cos, sin: [T, D]``.
    ``silu_and_mul(gate_up)``: ``half(silu(gate)) * up`` of ``[T, 2 * I]``, gate first.
    """

    DTYPES = (torch.bfloat16, torch.float32)

    def __init__(self, ext) -> None:
        self.rms_norm = ext.rms_norm
        self.add_rms_norm_ = ext.add_rms_norm_
        self.rotary_ = ext.rotary_
        self.silu_and_mul = ext.silu_and_mul


def fused_ops() -> FusedOps | None:
    """The fused ops, or None when the extension cannot be built (the failure is logged once)."""
    ext = load_extension()
    return FusedOps(ext) if ext is not None else None


PANEL = 16  # output columns per weight panel of ``linear_bf16w``


def pack_bf16_panels(weight: torch.Tensor) -> torch.Tensor:
    """``weight [N, K]`` rounded to bfloat16 (exact for a bfloat16 checkpoint) in the panels
    ``linear_bf16w`` reads: ``[ceil(N / 16), K, 16]``, panel ``p`` column ``c`` = output ``16 p + c``
    (padding columns zero)."""
    n, k = weight.shape
    num_panels = -(-n // PANEL)
    padded = torch.zeros(num_panels * PANEL, k, dtype=torch.bfloat16)
    padded[:n] = weight.detach().to(torch.bfloat16)
    return padded.view(num_panels, PANEL, k).transpose(1, 2).contiguous()


def linear_bf16w(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """``x [M, K]`` (float32, rows contiguous) times the packed weight: float32 ``[M, n]``, summed in
    float32. Raises ``RuntimeError`` where the extension is not available."""
    ext = load_extension()
    if ext is None:
        raise RuntimeError("the CPU kernel extension is not available")
    return ext.linear_bf16w(x, packed, n)


def linear_bf16w_path() -> str | None:
    """The inner loop ``linear_bf16w`` runs in this build: ``"avx512"``, ``"avx2"`` or ``"portable"``;
    None where the extension is not available."""
    ext = load_extension()
    return ext.linear_bf16w_path() if ext is not None else None
