"""What this CPU's instruction set offers the engine, read from ``/proc/cpuinfo`` (no torch).

Two consumers: the engine's ``dtype: auto`` (bfloat16 compute only where the CPU has native bfloat16
instructions; emulated, every bfloat16 GEMM is several times slower than float32) and the benchmarks,
which print the flags at the top of their output so that a figure is never read without its ISA.

oneDNN, which runs torch's bfloat16 matmuls on CPU, can be capped below the CPU's ISA with
``ONEDNN_MAX_CPU_ISA``; a cap below AVX-512 BF16 counts as "no native bfloat16" here, which is also how
an AVX-512 machine is made to choose what an AVX2-only one would.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

# The flags that decide the kernels' code paths and the compute type, in the order they are printed.
REPORTED_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "neon",
    "asimd",
)
# The flags that mean bfloat16 arithmetic in hardware (dot products of bfloat16 pairs, or AMX tiles).
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
# ONEDNN_MAX_CPU_ISA values that still let oneDNN use native bfloat16 (unset: no cap).
_NATIVE_BF16_CAPS = frozenset(
    {
        "",
        "ALL",
        "DEFAULT",
        "AVX512_CORE_BF16",
        "AVX512_CORE_FP16",
        "AVX512_CORE_AMX",
        "AVX512_CORE_AMX_FP16",
        "AVX10_1_512",
        "AVX10_1_512_AMX",
        "AVX10_1_512_AMX_FP16",
    }
)


@functools.cache
def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``); empty where they cannot be read."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def onednn_cap() -> str:
    """``ONEDNN_MAX_CPU_ISA`` as set (upper case), '' when unset."""
    return os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip().upper()


def native_bf16(flags: frozenset[str] | None = None, cap: str | None = None) -> bool:
    """Whether bfloat16 matmuls run natively here: the CPU has AVX-512 BF16 or AMX and oneDNN is not
    capped below them."""
    flags = cpu_flags() if flags is None else flags
    cap = onednn_cap() if cap is None else cap
    return bool(NATIVE_BF16_FLAGS & flags) and cap in _NATIVE_BF16_CAPS


def describe(flags: frozenset[str] | None = None) -> dict:
    """The machine's ISA for a benchmark's header and JSON: the decisive flags present, the oneDNN cap,
    whether bfloat16 is native, and the architecture."""
    flags = cpu_flags() if flags is None else flags
    return {
        "machine": platform.machine(),
        "flags": [f for f in REPORTED_FLAGS if f in flags],
        "onednn_max_cpu_isa": onednn_cap() or None,
        "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY") or None,
        "native_bf16": native_bf16(flags),
    }


def summary_line(flags: frozenset[str] | None = None) -> str:
    """One line for the top of a benchmark's output."""
    info = describe(flags)
    caps = [
        f"{name}={info[key]}"
        for name, key in (
            ("ONEDNN_MAX_CPU_ISA", "onednn_max_cpu_isa"),
            ("ATEN_CPU_CAPABILITY", "aten_cpu_capability"),
        )
        if info[key]
    ]
    native = "native bfloat16" if info["native_bf16"] else "no native bfloat16"
    return f"CPU ISA ({info['machine']}): {' '.join(info['flags']) or 'none of the listed'}; {native}" + (
        f" ({', '.join(caps)})" if caps else ""
    )
