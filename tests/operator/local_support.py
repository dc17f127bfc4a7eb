"""Shared pieces of the local-platform tests: a small InferenceService on the tiny checkpoint, the
platform on an event loop of its own (a thread), and the process checks behind "no orphans"."""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
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


class Traffic:
    """``workers`` threads sending completions through ``url`` (the front door) until :meth:`stop`,
    alternating plain and streamed ones, each asking for ``max_tokens`` with ``ignore_eos``.

    Every answer is counted in ``by_kind``: ``completed`` (200 and all tokens), ``refused`` (another
    status or no connection), ``cut_short`` (200 but fewer tokens, a stream that ended without
    ``[DONE]``, or one with an event that is not JSON); ``refused`` and ``cut_short`` keep the first
    20 reasons.
    """

    def __init__(self, url: str, workers: int = 3, max_tokens: int = 24) -> None:
        self.url, self.max_tokens = url, max_tokens
        self.completed = 0
        self.refused: list[str] = []
        self.cut_short: list[str] = []
        self.by_kind: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._work, args=(i,), daemon=True) for i in range(workers)]

    def start(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        """Stop sending and wait for the answers in flight (each is counted)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)

    def _work(self, index: int) -> None:
        body = {"model": MODEL_NAME, "max_tokens": self.max_tokens, "ignore_eos": True}
        with httpx.Client(base_url=self.url, timeout=120) as client:
            for n in itertools.count():
                if self._stop.is_set():
                    return
                stream = (index + n) % 2 == 1
                try:
                    outcome = self._one(client, {**body, "prompt": f"job {index}.{n}", "stream": stream})
                except httpx.HTTPError as exc:
                    outcome = ("refused", f"no answer: {exc!r}")
                with self._lock:
                    self.by_kind[outcome[0]] += 1
                    if outcome[0] == "completed":
                        self.completed += 1
                    elif len(getattr(self, outcome[0])) < 20:  # examples; ``by_kind`` counts them all
                        getattr(self, outcome[0]).append(outcome[1])

    def _one(self, client: httpx.Client, body: dict[str, Any]) -> tuple[str, str]:
        if not body["stream"]:
            response = client.post("/v1/completions", json=body)
            if response.status_code != 200:
                return "refused", f"{response.status_code}: {response.text[:200]}"
            tokens = response.json()["usage"]["completion_tokens"]
            return ("completed", "") if tokens == self.max_tokens else ("cut_short", f"{tokens} tokens")
        with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return "refused", f"{response.status_code}: {response.read()[:200]!r}"
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        try:
            chunks = [json.loads(e) for e in events if e != "[DONE]"]
        except json.JSONDecodeError as exc:  # an event broken off, or split by a line break in its text
            return "cut_short", f"an event that is not JSON: {exc}"
        reasons = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
        if events[-1:] != ["[DONE]"] or "length" not in reasons:
            return "cut_short", f"stream ended after {len(chunks)} chunks without [DONE]"
        return "completed", ""


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
