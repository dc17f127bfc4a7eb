"""The kernel build's lock: a build killed half-way never blocks the next start.

torch's extension builder guards a build directory with a plain lock file; a process killed during
the build (an OOM-killed pod, a server stopped while it compiled) leaves it behind, and every later
build of that directory would wait on it forever. The loader serialises builds with an ``flock`` of
its own instead, which the OS drops with its holder, and removes torch's stale file under it. The
compiler itself is replaced here by a recorder: these tests are about who builds and when.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types

import pytest

from kvpilot.kernels import cpu_build


@pytest.fixture
def builds(tmp_path, monkeypatch):
    """Point the cache at ``tmp_path``; record each real build (whether torch's lock file was there)."""
    monkeypatch.setenv("KVPILOT_KERNEL_CACHE", str(tmp_path))
    calls: list[bool] = []

    def fake_build(name, directory, openmp, target):
        calls.append((directory / cpu_build._TORCH_LOCK).exists())
        (directory / cpu_build._MARKER).write_text("ok\n")
        return types.ModuleType(name)

    monkeypatch.setattr(cpu_build, "_run_build", fake_build)
    return calls


def _directory(tmp_path):
    name = f"kvpilot_cpu_attention_{cpu_build.build_key(True, None)}"
    directory = tmp_path / name
    directory.mkdir()
    return name, directory


def test_a_stale_torch_lock_is_removed_before_building(tmp_path, builds):
    name, directory = _directory(tmp_path)
    (directory / cpu_build._TORCH_LOCK).write_text("")  # left by a build that was killed
    module = cpu_build._load(openmp=True)
    assert module.__name__ == name
    assert builds == [False]  # built once, with the stale file gone


def test_a_build_lock_held_by_a_killed_process_does_not_block(tmp_path, builds):
    _, directory = _directory(tmp_path)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import fcntl, sys, time
                f = open({str(directory / cpu_build._BUILD_LOCK)!r}, "w")
                fcntl.flock(f, fcntl.LOCK_EX)
                print("held", flush=True)
                time.sleep(600)
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        holder.kill()  # dies holding the lock, as a killed build would
        holder.wait(timeout=10)
        cpu_build._load(openmp=True)
    finally:
        if holder.poll() is None:
            holder.kill()
    assert builds == [False]


def test_a_build_finished_by_another_process_meanwhile_is_imported_not_rebuilt(tmp_path, builds, monkeypatch):
    name, directory = _directory(tmp_path)
    built_elsewhere = types.ModuleType(name)
    # The other process completed the build while this one waited for the lock.
    (directory / cpu_build._MARKER).write_text("ok\n")
    monkeypatch.setattr(cpu_build, "_import_built", lambda n, d: built_elsewhere if n == name else None)
    assert cpu_build._build(name, directory, True) is built_elsewhere
    assert builds == []
