"""The engine's default CPU thread count: every CPU the process may run on, unless set explicitly."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvpilot.engine import LLM
from kvpilot.engine.cpu_threads import (
    available_cpus,
    cgroup_cpu_limit,
    resolve_num_threads,
    torch_default_num_threads,
)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_is_the_tightest_along_the_path(tmp_path):
    _write(tmp_path / "proc", "0::/kubepods/pod1/ctr\n")
    _write(tmp_path / "cg/cpu.max", "max 100000\n")
    _write(tmp_path / "cg/kubepods/cpu.max", "800000 100000\n")
    _write(tmp_path / "cg/kubepods/pod1/ctr/cpu.max", "250000 100000\n")
    assert cgroup_cpu_limit(tmp_path / "proc", tmp_path / "cg") == 2.5
    assert available_cpus(proc_cgroup=tmp_path / "proc", root=tmp_path / "cg") == min(
        2, len(os.sched_getaffinity(0))
    )


def test_cgroup_v1_quota_falls_back_to_the_visible_root(tmp_path):
    """In a container the cgroup path in /proc/self/cgroup is not mounted; the root holds the quota."""
    _write(tmp_path / "proc", "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n")
    _write(tmp_path / "cg/cpu,cpuacct/cpu.cfs_quota_us", "150000\n")
    _write(tmp_path / "cg/cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_limit(tmp_path / "proc", tmp_path / "cg") == 1.5
    assert available_cpus(proc_cgroup=tmp_path / "proc", root=tmp_path / "cg") == 1


@pytest.mark.parametrize(
    "content",
    ["0::/\n", "3:cpu:/\n", "garbage\n"],
    ids=["v2-max", "v1-unlimited", "unparsable"],
)
def test_no_quota_means_the_affinity_mask(tmp_path, content):
    _write(tmp_path / "proc", content)
    _write(tmp_path / "cg/cpu.max", "max 100000\n")
    _write(tmp_path / "cg/cpu/cpu.cfs_quota_us", "-1\n")
    _write(tmp_path / "cg/cpu/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_limit(tmp_path / "proc", tmp_path / "cg") is None
    assert available_cpus(proc_cgroup=tmp_path / "proc", root=tmp_path / "cg") == len(os.sched_getaffinity(0))


def test_torch_default_counts_physical_cores(tmp_path):
    for cpu, (package, core) in enumerate([(0, 0), (0, 0), (0, 1), (0, 1), (1, 0), (1, 0)]):
        _write(tmp_path / f"cpu{cpu}/topology/physical_package_id", f"{package}\n")
        _write(tmp_path / f"cpu{cpu}/topology/core_id", f"{core}\n")
    assert torch_default_num_threads(tmp_path) == 3


def test_explicit_settings_win():
    assert resolve_num_threads({"OMP_NUM_THREADS": "3"}, current=3, default=8) == (3, "OMP_NUM_THREADS")
    assert resolve_num_threads({"MKL_NUM_THREADS": "2"}, current=2, default=8)[1] == "MKL_NUM_THREADS"
    assert resolve_num_threads({}, current=5, default=8) == (5, "torch.set_num_threads")
    threads, why = resolve_num_threads({}, current=8, default=8)
    assert threads == available_cpus() and "affinity" in why


def test_engine_start_sets_the_default_and_keeps_an_explicit_one(tiny_llama, monkeypatch):
    """With torch at its default, the engine runs on the available CPUs; after an explicit
    ``torch.set_num_threads`` it keeps that count."""
    saved = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    # Pretend the machine's default is the current count, whatever this session has done to it.
    monkeypatch.setattr("kvpilot.engine.cpu_threads.torch_default_num_threads", lambda: saved)
    monkeypatch.setattr("kvpilot.engine.cpu_threads.available_cpus", lambda: saved + 1)
    try:
        llm = LLM(str(tiny_llama), device="cpu", num_gpu_blocks_override=64)
        assert llm.llm_engine.engine_config.num_threads == saved + 1
        assert torch.get_num_threads() == saved + 1
        llm.shutdown()
        explicit = saved + 2  # neither the (pretended) default nor the available count
        torch.set_num_threads(explicit)
        llm = LLM(str(tiny_llama), device="cpu", num_gpu_blocks_override=64)
        assert llm.llm_engine.engine_config.num_threads == explicit
        assert torch.get_num_threads() == explicit
        llm.shutdown()
    finally:
        torch.set_num_threads(saved)


def test_resolving_the_config_sets_no_threads(tiny_llama, monkeypatch):
    """``engine_config.resolve`` only decides the count; the engine applies it when it starts."""
    from kvpilot.engine.config import EngineArgs
    from kvpilot.engine.engine_config import resolve
    from kvpilot.engine.llm_engine import load_tokenizer
    from kvpilot.engine.models.config import ModelConfig

    saved = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr("kvpilot.engine.cpu_threads.torch_default_num_threads", lambda: saved)
    monkeypatch.setattr("kvpilot.engine.cpu_threads.available_cpus", lambda: saved + 1)
    config = resolve(
        EngineArgs(model=str(tiny_llama), device="cpu"),
        str(tiny_llama),
        ModelConfig.from_pretrained(tiny_llama),
        load_tokenizer(tiny_llama),
    )
    assert (config.num_threads, torch.get_num_threads()) == (saved + 1, saved)
    assert "affinity" in config.threads_reason
