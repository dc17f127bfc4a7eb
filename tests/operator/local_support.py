"""Shared pieces of the local-platform tests: a small InferenceService on the tiny checkpoint, the
platform on an event loop of its own (a thread), and the process checks behind "no orphans"."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvpilot.operator.api import names
from kvpilot.operator.local.platform import LocalPlatform

MODEL_NAME = "tiny"


def tiny_isvc(model: Path, replicas: int = 1, **engine: Any) -> dict[str, Any]:
    """An InferenceService on ``model``: CPU, one thread per replica, remediation Off unless changed."""
    return {
        "apiVersion": names.API_VERSION,
        "kind": names.KIND,
        "metadata": {"name": "tiny", "namespace": "local"},
        "spec": {
            "model": {"source": f"file://{model}", "name": MODEL_NAME},
            "image": "kvpilot-engine:test",
            "replicas": replicas,
            "resources": {"gpusPerReplica": 0, "cpu": "1"},
            "engine": {
                "device": "cpu",
                "maxModelLen": 128,
                "maxNumBatchedTokens": 256,
                "cpuMemoryBudgetBytes": 64_000_000,
                "gpuMemoryUtilization": 0.5,
                **engine,
            },
            "probes": {"startupTimeoutSeconds": 120},
            "remediation": {"mode": "Off", "window": "6s", "cooldown": "8s"},
        },
    }


def write_manifest(path: Path, isvc: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(isvc, sort_keys=False))
    return path


class PlatformThread:
    """A :class:`LocalPlatform` running on an event loop in a thread of its own; the test thread talks to it
    over HTTP and through :meth:`call`. Replicas are spawned from that thread and die with it."""

    def __init__(self, isvc: dict[str, Any], tmp: Path, **options: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        options.setdefault("port", 0)
        options.setdefault("scrape_interval", 1.0)
        options.setdefault("status_interval", 3600.0)
        self.platform: LocalPlatform = self.call(self._make(isvc, tmp / "logs", options))
        self.url = ""

    @staticmethod
    async def _make(isvc: dict[str, Any], log_dir: Path, options: dict[str, Any]) -> LocalPlatform:
        return LocalPlatform(isvc, log_dir=log_dir, **options)

    def call(self, coro, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> PlatformThread:
        self.url = self.call(self.platform.start())
        return self

    def stop(self) -> None:
        if self.thread.is_alive():
            try:
                self.call(self.platform.close(), timeout=60)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self.thread.join(timeout=10)

    def status(self) -> dict[str, Any]:
        return httpx.get(self.url + "/local/status", timeout=10).json()

    def ready_replicas(self, count: int, current: bool = True) -> list[dict[str, Any]] | None:
        """The replicas when exactly ``count`` exist and all are ready (on the current configuration)."""
        replicas = self.status()["replicas"]
        if len(replicas) == count and all(r["ready"] and (r["current"] or not current) for r in replicas):
            return replicas
        return None


def process_group_members(pgids: set[int]) -> list[int]:
    """PIDs of live processes whose process group is one of ``pgids`` (read from /proc)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        state, pgrp = fields[0], int(fields[2])
        if pgrp in pgids and state != "Z":
            members.append(int(entry.name))
    return members


def is_alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def leftovers(pids: list[int]) -> list[int]:
    """Processes still alive among ``pids`` or in their process groups (each replica leads one)."""
    return sorted({p for p in pids if is_alive(p)} | set(process_group_members(set(pids)))) if pids else []
