"""``make demo``'s load and live view: the streaming clients that drive the platform (:class:`Load`),
the once-a-second sampler of ``/local/status`` and every ready replica's ``/metrics``
(:class:`Monitor`), and the rows of the live table (:func:`live_line`).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import aiohttp

from kvpilot.operator.api import names
from kvpilot.operator.demo.prepare import CONCURRENCY, PROMPT_LEN
from kvpilot.operator.demo.report import Sample, Timeline, Trip
from kvpilot.operator.remediation.metrics import parse_scrape


class Load:
    """CONCURRENCY streaming clients in a closed loop; every finished request becomes a Trip."""

    def __init__(self, url: str, model_name: str, vocab: int, max_tokens: int, seed: int = 0) -> None:
        self.url = url
        self.max_tokens = max_tokens
        self.model_name = model_name
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.trips: list[Trip] = []
        self.refused = 0
        self.stopping = asyncio.Event()

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.gather(*(self._client(session) for _ in range(CONCURRENCY)))

    async def _client(self, session: aiohttp.ClientSession) -> None:
        while not self.stopping.is_set():
            prompt = [self.rng.randrange(5, self.vocab) for _ in range(PROMPT_LEN)]
            body = {
                "model": self.model_name,
                "prompt": prompt,
                "max_tokens": self.max_tokens,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            start, first, tokens = time.time(), None, 0
            try:
                async with session.post(self.url + "/v1/completions", json=body) as response:
                    if response.status != 200:
                        self.refused += 1
                        await asyncio.sleep(0.2)
                        continue
                    async for line in response.content:
                        if not line.startswith(b"data: {"):
                            continue
                        event = json.loads(line[6:])
                        if event.get("choices") and first is None:
                            first = time.time()
                        if event.get("usage"):
                            tokens = event["usage"]["completion_tokens"]
            except (aiohttp.ClientError, TimeoutError):
                self.refused += 1
                await asyncio.sleep(0.2)
                continue
            if first is not None and tokens:
                self.trips.append(Trip(start, first, time.time(), tokens))


class Monitor:
    """Samples the platform once a second: ``/local/status`` and every ready replica's ``/metrics``."""

    def __init__(self, url: str, t0: float) -> None:
        self.url = url
        self.timeline = Timeline(t0)
        self.status: dict[str, Any] = {}
        self._counters: dict[str, float] = {}
        self._last_time: float | None = None

    async def sample(self, session: aiohttp.ClientSession) -> Sample | None:
        try:
            async with session.get(self.url + "/local/status") as response:
                self.status = await response.json()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        now = time.time()
        replicas = [r for r in self.status.get("replicas", []) if r["ready"]]
        scrapes = await asyncio.gather(*(self._scrape(session, r["url"]) for r in replicas))
        increase = 0.0
        kv, waiting, running, blocks = [], 0.0, 0.0, []
        for replica, scrape in zip(replicas, scrapes, strict=True):
            if scrape is None or scrape.missing:
                continue
            before = self._counters.get(replica["name"])
            value = scrape.preemptions or 0.0
            if before is not None:
                increase += value - before if value >= before else value  # a restart resets the counter
            self._counters[replica["name"]] = value
            kv.append(scrape.kv_usage or 0.0)
            waiting += scrape.waiting or 0.0
            running += scrape.running or 0.0
            if "num_gpu_blocks" in scrape.cache_info:
                blocks.append(int(scrape.cache_info["num_gpu_blocks"]))
        dt = now - self._last_time if self._last_time is not None else None
        self._last_time = now
        isvc = self.status.get("inferenceService") or {}
        effective = (isvc.get("status") or {}).get("effective") or {}
        sample = Sample(
            time=now,
            replicas_ready=len(replicas),
            replicas_desired=int(effective.get("replicas", 1)),
            preemption_rate=increase / dt if dt else 0.0,
            preemptions=increase,
            kv_usage=sum(kv) / len(kv) if kv else None,
            waiting=waiting,
            running=running,
            num_blocks=min(blocks) if blocks else None,
            gpu_memory_utilization=effective.get("gpuMemoryUtilization"),
            max_num_seqs=effective.get("maxNumSeqs"),
        )
        self.timeline.samples.append(sample)
        return sample

    async def _scrape(self, session: aiohttp.ClientSession, url: str):
        try:
            async with session.get(url + names.METRICS_PATH) as response:
                return parse_scrape(await response.text(), time.time())
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    def remediations(self) -> list[dict[str, Any]]:
        """``status.remediations``, oldest first."""
        status = (self.status.get("inferenceService") or {}).get("status") or {}
        return list(reversed(status.get("remediations") or []))

    def rolled_out(self) -> bool:
        """Every desired replica ready on the current configuration, none left on an older one."""
        replicas = self.status.get("replicas") or []
        isvc = self.status.get("inferenceService") or {}
        desired = int(((isvc.get("status") or {}).get("effective") or {}).get("replicas", 1))
        current = [r for r in replicas if r["current"] and r["ready"]]
        return len(current) == desired and len(replicas) == desired


HEADER = "  ".join(
    f"{title:>{width}}"
    for title, width in (
        ("time", 6),
        ("replicas", 8),
        ("preempt/s", 9),
        ("KV cache", 8),
        ("waiting", 7),
        ("running", 7),
        ("done", 5),
        ("tok/s", 6),
        ("mem. fraction", 13),
        ("max seqs", 8),
    )
)


def live_line(sample: Sample, t0: float, load: Load, window: list[Sample]) -> str:
    """One row of the live table (rates over the last few samples)."""
    span = window[-1].time - window[0].time if len(window) > 1 else 0.0
    rate = sum(s.preemptions for s in window[1:]) / span if span else 0.0
    recent = [t for t in load.trips if t.end >= window[0].time] if window else []
    tok_s = sum(t.tokens for t in recent) / span if span else 0.0
    kv = f"{sample.kv_usage:.0%}" if sample.kv_usage is not None else "-"
    fraction = f"{sample.gpu_memory_utilization:g}" if sample.gpu_memory_utilization is not None else "-"
    seqs = str(sample.max_num_seqs) if sample.max_num_seqs is not None else "-"
    return (
        f"{sample.time - t0:5.0f}s  {sample.replicas_ready:>4}/{sample.replicas_desired:<3}  {rate:9.1f}  "
        f"{kv:>8}  {sample.waiting:7.0f}  {sample.running:7.0f}  {len(load.trips):5d}  {tok_s:6.0f}  "
        f"{fraction:>13}  {seqs:>8}"
    )
