"""How many intra-op threads the engine runs with on CPU: what the process may use (its affinity mask and
its cgroup's CPU quota) unless the user set a count.

torch's own default is the machine's physical cores, whatever the process may actually run on: in a
container limited to 4 CPUs of a 64-core node it starts 32 threads that the quota then throttles.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger("kvpilot.engine")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _positive(text: str | None) -> bool:
    return bool(text) and text.isdigit() and int(text) > 0


def cgroup_cpu_limit(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")):
    """The CPU quota of this process's cgroup (the tightest along its path) in CPUs, or None for no quota.

    Reads cgroup v2 ``cpu.max`` (``"max 100000"`` or ``"<quota> <period>"``) and v1
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (quota -1: none). A path that is not visible (a
    container sees its own cgroup as the root) falls back to the root's files.
    """
    text = _read(proc_cgroup)
    if text is None:
        return None
    limits: list[float] = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        names = [p for p in path.split("/") if p]
        if controllers == "":  # cgroup v2: every ancestor's cpu.max limits the process
            for depth in range(len(names), -1, -1):
                value = _read(root.joinpath(*names[:depth], "cpu.max"))
                quota, _, period = (value or "max").partition(" ")
                if quota != "max" and _positive(quota) and _positive(period):
                    limits.append(int(quota) / int(period))
        elif "cpu" in controllers.split(","):
            for base in (root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"):
                for directory in (base.joinpath(*names), base):
                    quota = _read(directory / "cpu.cfs_quota_us")
                    period = _read(directory / "cpu.cfs_period_us")
                    if _positive(quota) and _positive(period):
                        limits.append(int(quota) / int(period))
                        break
    return min(limits) if limits else None


def available_cpus(**cgroup_paths) -> int:
    """CPUs this process may run on: its affinity mask, capped by its cgroup's CPU quota (rounded down,
    so that the threads are never throttled), at least 1."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
    limit = cgroup_cpu_limit(**cgroup_paths)
    if limit is not None:
        count = min(count, int(limit))
    return max(1, count)


def torch_default_num_threads(cpu_root: Path = Path("/sys/devices/system/cpu")) -> int:
    """The thread count torch picks when nothing sets one: the machine's physical cores (as cpuinfo
    counts them), else its logical CPUs."""
    cores = set()
    for topology in cpu_root.glob("cpu[0-9]*/topology"):
        package, core = _read(topology / "physical_package_id"), _read(topology / "core_id")
        if package is not None and core is not None:
            cores.add((package, core))
    return len(cores) or os.cpu_count() or 1


def resolve_num_threads(environ=os.environ, current: int | None = None, default: int | None = None):
    """``(threads, why)``: an explicit setting wins (``OMP_NUM_THREADS`` / ``MKL_NUM_THREADS``, or
    ``torch.set_num_threads`` called before the engine starts, seen as a count other than torch's
    default), else every CPU the process may run on (``available_cpus``)."""
    current = torch.get_num_threads() if current is None else current
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        if environ.get(name, "").strip():
            return current, name
    if current != (torch_default_num_threads() if default is None else default):
        return current, "torch.set_num_threads"
    return available_cpus(), "the CPUs this process may run on (affinity and cgroup quota)"


def apply_num_threads(threads: int, why: str) -> None:
    """Set torch's intra-op thread count to ``threads`` (from ``resolve_num_threads``) and log it."""
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    logger.info("CPU threads: %d (%s)", threads, why)
