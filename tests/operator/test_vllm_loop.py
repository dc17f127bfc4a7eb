"""The closed loop against a real vLLM server: a storm its KV pool cannot hold, ended by remediation.

The test plays kubelet for one engine pod of ``runtime: vllm``: it runs vLLM 0.32's CPU build with the
args the operator renders into the Deployment (host, port and model directory made local by the local
platform's own function), drives a load the pool cannot
hold, and feeds every scrape through the same functions the operator's loop runs (``PodSeries`` ->
``summarize`` -> ``evaluate``). When the policy acts, the status patch is applied, the args are
rendered again and the server is restarted with them, as a rollout would, and the same load runs
again. vLLM's own ``/metrics`` says whether the storm ended: preemptions and the KV pool, before and
after.

The pool is sized with ``cpuMemoryBudgetBytes``: on vLLM's CPU backend the memory fraction of that
budget is the KV pool (``api/runtime.cpu_kv_cache_bytes``), so raising ``gpuMemoryUtilization`` from
0.1 to 0.15 grows the pool by half: room for the 4 concurrent requests the first pool could not hold.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from pathlib import Path

import pytest

from benchmarks.vllm_storm import bytes_per_block, completion, counter, free_port, get, vllm_server
from kvpilot.operator.api.patch import merge_patch
from kvpilot.operator.api.settings import resolve
from kvpilot.operator.local import process
from kvpilot.operator.remediation.evaluate import evaluate
from kvpilot.operator.remediation.metrics import capacity_of, parse_scrape
from kvpilot.operator.remediation.series import PodSeries
from kvpilot.operator.remediation.window import summarize
from kvpilot.operator.render import vllm
from kvpilot.operator.render.builders import build_deployment
from kvpilot.operator.render.vllm import VLLM_MODULE
from tests.operator.test_vllm_args import vllm_python

pytestmark = pytest.mark.timeout(900)

BLOCKS_BEFORE = 24  # 0.1 of the budget
CONCURRENCY = 4  # each request ends at 96 + 160 tokens = 8 blocks of 32: 32 blocks for all four
PROMPT, OUTPUT = 96, 160
WINDOW_S = 10
# The loop scrapes about once a second, but vLLM's API server shares two cores with its engine core and
# the load here, and a /metrics answer can take seconds: a gap up to this long keeps the window usable.
STALE_S = 8.0


def make_isvc(budget: int) -> dict:
    return {
        "apiVersion": "serving.kvpilot.io/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "llm", "namespace": "llm", "generation": 1},
        "spec": {
            "runtime": "vllm",
            "model": {"source": "pvc://models/llm", "name": "llm"},
            "engine": {
                "gpuMemoryUtilization": 0.1,
                "cpuMemoryBudgetBytes": budget,
                "blockSize": 32,
                "maxModelLen": 512,
                "maxNumSeqs": 8,
                "enablePrefixCaching": False,
                "dtype": "bfloat16",
            },
            "remediation": {
                "mode": "Auto",
                "window": f"{WINDOW_S}s",
                "cooldown": "10m",
                "preemptionRate": 0.5,
            },
        },
    }


class Load(threading.Thread):
    """``CONCURRENCY`` clients, each sending one request after another until stopped."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.completed = 0
        self.failed: list[str] = []
        self._stop_event = threading.Event()
        self._lock = threading.Lock()

    def _client(self, index: int) -> None:
        seed = index * 1000
        while not self._stop_event.is_set():
            try:
                completion(self.url, "llm", PROMPT, OUTPUT, seed)
                with self._lock:
                    self.completed += 1
            except Exception as exc:  # noqa: BLE001 (counted and asserted on)
                with self._lock:
                    self.failed.append(f"{type(exc).__name__}: {exc}")
            seed += 1

    def run(self) -> None:
        with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
            for index in range(CONCURRENCY):
                pool.submit(self._client, index)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=300)


def _args(settings, model_dir: Path, port: int) -> list[str]:
    """The engine container's args as rendered into the Deployment, made local as ``kvpilot up
    --local`` makes them (its kubelet's own function)."""
    assert settings.is_valid, settings.problems
    (container,) = build_deployment(settings)["spec"]["template"]["spec"]["containers"]
    assert container["command"] == vllm.VLLM_COMMAND
    assert process.replica_command(container, "python")[1:] == ["-m", VLLM_MODULE]
    args, _ = process.local_args(container, port, model_dir=str(model_dir), gpu=False)
    return args


def test_remediation_ends_a_preemption_storm_on_real_vllm(tmp_path: Path) -> None:
    from kvpilot.engine.models.synthetic import build_checkpoint

    python = vllm_python()
    model_dir = build_checkpoint(tmp_path / "model", size="10m", seed=0, dtype="bfloat16")
    budget = int(BLOCKS_BEFORE * bytes_per_block(model_dir) / 0.1)
    state = make_isvc(budget)
    settings = resolve(state)
    assert settings.is_valid, settings.problems

    # 1. The storm: scrape once a second through the operator's functions until the policy acts.
    port = free_port()
    with vllm_server(python, _args(settings, model_dir, port), port=port, workdir=tmp_path) as server:
        first = parse_scrape(get(server.url + "/metrics"), time.time())
        blocks_before = capacity_of(first).num_gpu_blocks
        load = Load(server.url)
        load.start()
        series = PodSeries("llm-0", retention_s=3 * WINDOW_S)
        decision = None
        storm_began = time.monotonic()
        while time.monotonic() - storm_began < 240:
            now = time.time()
            series.ingest(now, get(server.url + "/metrics"), None)
            window = summarize(
                {"llm-0": series}, now=now, window_s=WINDOW_S, stale_after_s=STALE_S, problems=[]
            )
            decision, update = evaluate(settings, window, now)
            if decision.action == "apply":
                break
            time.sleep(1.0)
        storm_s = time.monotonic() - storm_began
        text = get(server.url + "/metrics")
        load.stop()
        preempted_before = counter(text, "vllm:num_preemptions_total")
        completed_before = load.completed
    assert decision is not None and decision.action == "apply", decision and decision.reason
    assert (decision.field, decision.from_, decision.to) == ("gpuMemoryUtilization", 0.1, 0.15)
    assert load.failed == []
    assert preempted_before >= 5, preempted_before  # a storm by vLLM's own count

    # 2. The rollout: the status patch applied, the args rendered again, the server restarted with them.
    state = {**state, "status": merge_patch(state.get("status"), update.patch)}
    settings = settings.with_status(state)
    assert settings.effective.engine["gpuMemoryUtilization"] == 0.15
    port = free_port()
    with vllm_server(python, _args(settings, model_dir, port), port=port, workdir=tmp_path) as server:
        blocks_after = capacity_of(parse_scrape(get(server.url + "/metrics"), time.time())).num_gpu_blocks
        load = Load(server.url)
        load.start()
        series = PodSeries("llm-0", retention_s=3 * WINDOW_S)
        began = time.monotonic()
        decisions = []
        while load.completed < 3 * completed_before // 2 + CONCURRENCY and time.monotonic() - began < 240:
            now = time.time()
            series.ingest(now, get(server.url + "/metrics"), None)
            window = summarize(
                {"llm-0": series}, now=now, window_s=WINDOW_S, stale_after_s=STALE_S, problems=[]
            )
            decisions.append(evaluate(settings, window, now)[0])
            time.sleep(1.0)
        text = get(server.url + "/metrics")
        load.stop()
        preempted_after = counter(text, "vllm:num_preemptions_total")
        completed_after = load.completed
    print(
        f"vLLM KV pool {blocks_before} -> {blocks_after} blocks; preemptions {preempted_before:g} over "
        f"{completed_before} requests ({storm_s:.0f} s until the policy acted) -> {preempted_after:g} over "
        f"{completed_after} requests"
    )
    assert blocks_after > blocks_before
    assert load.failed == []
    assert completed_after > completed_before  # the same load ran at least as long as the storm did
    assert preempted_after == 0, preempted_after
    assert not any(d.action == "apply" for d in decisions), [
        d.reason for d in decisions if d.action == "apply"
    ]
