"""The remediation loop at scale: 200 engine pods across 20 InferenceServices in one operator.

The loop runs in-process against the local platform's in-memory API, every pod pointing at one
scripted engine that serves a vLLM-sized ``/metrics`` (~25 KiB, histograms included). The test checks
that every InferenceService is judged on all its pods, and measures the operator's RSS growth, the
tick time and the longest stall of the event loop during a tick (printed, and written as JSON to
``$KVPILOT_SCALE_JSON`` when set); it bounds only the memory, never the speed.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import time

from prometheus_client import Histogram

from kvpilot.operator.api import names
from kvpilot.operator.api.rest import object_path
from kvpilot.operator.local.api import LocalApi
from kvpilot.operator.local.platform import prepare
from kvpilot.operator.options import OperatorOptions
from kvpilot.operator.reconcile.reconciler import Reconciler
from kvpilot.operator.remediation.loop import Autotuner
from tests.operator.conftest import BASE_ISVC
from tests.operator.engine_metrics import EngineMetrics, ScriptedEngine

NS, SERVICES, REPLICAS, TICKS = "llm", 20, 10, 4
BUCKETS = [0.001 * 2**i for i in range(24)]


def rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        line = next(x for x in status if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def vllm_sized_engine() -> EngineMetrics:
    """An engine exposition of about vLLM's size: the required metrics plus 10 latency histograms."""
    metrics = EngineMetrics(max_num_seqs=64).set(kv=0.5, waiting=0, running=10)
    for index in range(10):
        histogram = Histogram(f"vllm:latency_{index}_seconds", "Latency.", ["model_name"], buckets=BUCKETS,
                              registry=metrics.registry).labels("llama")  # fmt: skip
        for value in (0.01, 0.2, 3.0):
            histogram.observe(value)
    return metrics


def pod(service: str, index: int, labels: dict, port: int) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{service}-{index}",
            "namespace": NS,
            "uid": f"uid-{service}-{index}",
            "labels": labels,
        },  # fmt: skip
        "spec": {
            "containers": [
                {
                    "name": names.ENGINE_CONTAINER,
                    "ports": [{"name": names.HTTP_PORT_NAME, "containerPort": port}],
                }
            ]
        },  # fmt: skip
        "status": {
            "podIP": "127.0.0.1",
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


async def measure() -> dict:
    api = LocalApi()

    async def no_events(*_):
        return None

    reconciler = Reconciler(api, no_events)
    engine = ScriptedEngine(vllm_sized_engine())
    body_bytes = len(engine.metrics.text().encode())
    for number in range(SERVICES):
        name = f"svc-{number:02d}"
        isvc = copy.deepcopy(BASE_ISVC)
        isvc["metadata"] = {"name": name, "namespace": NS}
        isvc["spec"]["replicas"] = REPLICAS
        isvc["spec"]["remediation"] = {"mode": "Recommend", "window": "45s", "cooldown": "600s",
                                       "limits": {"maxReplicas": 12}}  # fmt: skip
        await api.create(prepare(isvc, NS))
        await reconciler.run(NS, name, logging.getLogger(__name__))
        deployment = api.read(object_path("apps/v1", "Deployment", NS, name))
        labels = dict(deployment["spec"]["template"]["metadata"]["labels"])
        for index in range(REPLICAS):
            api.put(object_path("v1", "Pod", NS, f"{name}-{index}"), pod(name, index, labels, engine.port))
    clock = [1_750_000_000.0]
    options = OperatorOptions(namespaces=(NS,), scrape_interval=15.0, scrape_timeout=10.0)
    tuner = Autotuner(api, options, reconciler, clock=lambda: clock[0])
    stall = [0.0]

    async def heartbeat() -> None:
        while True:
            began = time.monotonic()
            await asyncio.sleep(0.005)
            stall[0] = max(stall[0], time.monotonic() - began - 0.005)

    beat = asyncio.create_task(heartbeat())
    before = rss_bytes()
    tick_s = []
    try:
        for _ in range(TICKS):
            began = time.monotonic()
            await tuner.tick()
            tick_s.append(time.monotonic() - began)
            clock[0] += 15.0
    finally:
        beat.cancel()
        await tuner.close()
        engine.stop()
    reporting = {}
    for number in range(SERVICES):
        status = (
            api.read(object_path(names.API_VERSION, names.KIND, NS, f"svc-{number:02d}")).get("status") or {}
        )
        reporting[number] = (status.get("signals") or {}).get("podsReporting")
    return {
        "pods": SERVICES * REPLICAS,
        "inference_services": SERVICES,
        "body_bytes": body_bytes,
        "requests": engine.requests,
        "tick_s": [round(t, 3) for t in tick_s],
        "max_loop_stall_s": round(stall[0], 3),
        "rss_before_mib": round(before / 2**20, 1),
        "rss_growth_mib": round((rss_bytes() - before) / 2**20, 1),
        "pods_reporting": reporting,
    }


def test_two_hundred_pods_across_twenty_services():
    result = asyncio.run(measure())
    print(json.dumps({k: v for k, v in result.items() if k != "pods_reporting"}))
    if os.environ.get("KVPILOT_SCALE_JSON"):
        with open(os.environ["KVPILOT_SCALE_JSON"], "w", encoding="utf-8") as out:
            json.dump(result, out, indent=2)
    assert result["requests"] == SERVICES * REPLICAS * TICKS  # every pod scraped every tick
    assert set(result["pods_reporting"].values()) == {REPLICAS}  # every service judged on all its pods
    assert 20_000 <= result["body_bytes"] <= 60_000
    # The series hold a window of parsed scrapes, not bodies: far below the chart's 256 Mi limit.
    assert result["rss_growth_mib"] < 64
