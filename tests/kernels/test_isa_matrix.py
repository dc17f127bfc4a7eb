"""The kernels' ISA levels (``cpu_build.ISA_LEVELS``): what this CPU can run is tested level by level
(the ``kernel_isa`` fixture of the CPU kernel tests); what it cannot run is compiled here, so that a
level's code that does not build is a failure on every machine, and named in the run's summary."""

from __future__ import annotations

import platform

import pytest

from kvpilot.kernels import cpu_build, isa

x86_only = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the levels are x86-64's")


@x86_only
def test_levels_split_by_the_cpus_flags():
    runnable, missing = cpu_build.isa_levels(frozenset({"sse4_2", "avx2", "fma", "f16c", "avx512f"}))
    assert [level.name for level in runnable] == ["portable", "avx2"]
    assert [level.name for level in missing] == ["avx512", "avx512_bf16", "amx"]
    everything = frozenset().union(*(level.needs for level in cpu_build.ISA_LEVELS))
    assert cpu_build.isa_levels(everything)[1] == []
    # Each level needs at least what the one before it needs.
    for lower, higher in zip(cpu_build.ISA_LEVELS, cpu_build.ISA_LEVELS[1:], strict=False):
        assert lower.needs < higher.needs


@x86_only
def test_this_cpu_runs_the_levels_its_flags_allow():
    runnable, missing = cpu_build.isa_levels()
    flags = isa.cpu_flags()
    assert all(level.needs <= flags for level in runnable)
    assert all(not level.needs <= flags for level in missing)
    assert "avx2" in [level.name for level in runnable], "x86-64 machines this project supports have AVX2"


@x86_only
def test_the_levels_this_cpu_cannot_run_still_compile():
    """The highest level this CPU lacks includes every lower one's code paths (its flags are a
    superset); compiling it checks the AVX-512, AVX512-BF16 and AMX code on an AVX2 machine."""
    _, missing = cpu_build.isa_levels()
    if not missing:
        pytest.skip("this CPU runs every level; nothing is compile-only")
    cpu_build.compile_level(missing[-1])
