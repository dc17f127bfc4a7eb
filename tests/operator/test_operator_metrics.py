"""The operator's own metrics (``kvpilot_operator_*``): what the remediation loop and the reconciler
record, counted on a scripted storm, served over HTTP, and removed with their InferenceService.

The loop runs in-process against the local platform's in-memory API (as in test_remediation_tick),
its pods pointing at scripted engines, on the test's clock.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.operator.api import names
from kvpilot.operator.api.rest import object_path
from kvpilot.operator.api.settings import resolve
from kvpilot.operator.local.api import LocalApi
from kvpilot.operator.local.platform import prepare
from kvpilot.operator.observability import MetricsServer, OperatorMetrics, classify_decision
from kvpilot.operator.options import OperatorOptions
from kvpilot.operator.reconcile.reconciler import Reconciler
from kvpilot.operator.remediation.decision import APPLY, NONE, RAISE_GPU_MEMORY, REVERT, Decision
from kvpilot.operator.remediation.loop import Autotuner
from kvpilot.operator.remediation.pods import Failure
from kvpilot.operator.remediation.window import MetricWindow
from tests.operator.conftest import BASE_ISVC, FAST_ROLLOUT_REMEDIATION
from tests.operator.engine_metrics import EngineMetrics, ScriptedEngine

NS, NAME = "llm", "llama"
ISVC_PATH = object_path(names.API_VERSION, names.KIND, NS, NAME)
DEPLOYMENT_PATH = object_path("apps/v1", "Deployment", NS, NAME)
START = 1_750_000_000.0


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition: (name, sorted labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(text: str, name: str, **labels: str) -> float | None:
    key = (name, tuple(sorted({"namespace": NS, "inferenceservice": NAME, **labels}.items())))
    return samples(text).get(key)


def _pod(index: int, labels: dict, port: int) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{NAME}-{index}", "namespace": NS, "uid": f"uid-{index}", "labels": labels},
        "spec": {
            "containers": [
                {
                    "name": names.ENGINE_CONTAINER,
                    "ports": [{"name": names.HTTP_PORT_NAME, "containerPort": port}],
                }
            ]
        },
        "status": {
            "podIP": "127.0.0.1",
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


async def _storm(delete: bool = True) -> dict:
    """A storm in Auto mode on one scripted pod: expositions after the remediation, after the pod stops
    answering, and (``delete``) after the InferenceService is deleted; ``metrics``: the registry's owner."""
    api = LocalApi()
    isvc = copy.deepcopy(BASE_ISVC)
    isvc["spec"]["replicas"] = 1
    isvc["spec"]["engine"] = {"maxNumSeqs": 128, "gpuMemoryUtilization": 0.8}
    isvc["spec"]["remediation"] = dict(FAST_ROLLOUT_REMEDIATION)
    await api.create(prepare(isvc, NS))

    async def no_events(*_):
        return None

    metrics = OperatorMetrics()
    reconciler = Reconciler(api, no_events, metrics=metrics)
    await reconciler.run(NS, NAME, logging.getLogger(__name__))
    labels = api.read(DEPLOYMENT_PATH)["spec"]["template"]["metadata"]["labels"]
    engine = ScriptedEngine(EngineMetrics(max_num_seqs=128).set(kv=0.9, waiting=0, running=10))
    api.put(object_path("v1", "Pod", NS, f"{NAME}-0"), _pod(0, dict(labels), engine.port))
    clock = [START]
    tuner = Autotuner(
        api,
        OperatorOptions(namespaces=(NS,), scrape_interval=1.0),
        reconciler,
        clock=lambda: clock[0],
        metrics=metrics,
    )
    server = MetricsServer(metrics.registry, 0, "127.0.0.1").start()
    url = f"http://127.0.0.1:{server.port}/metrics"

    def fetch() -> str:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.read().decode()

    out, rolled = {}, -1
    try:
        for _ in range(8):  # a full 4 s window, the change, then cooldown
            engine.metrics.preempt(10)
            await tuner.tick()
            clock[0] += 1.0
            current = api.read(DEPLOYMENT_PATH)["spec"]["template"]["metadata"]["labels"]
            if current != labels and rolled < 0:
                rolled = 1  # one tick sees the pod on the old configuration, then it rolls over
            elif rolled == 1:
                api.put(object_path("v1", "Pod", NS, f"{NAME}-0"), _pod(0, dict(current), engine.port))
                rolled = 0
        out["storm"] = await asyncio.to_thread(fetch)
        engine.stop()  # the pod stops answering
        await tuner.tick()
        clock[0] += 1.0
        out["down"] = await asyncio.to_thread(fetch)
        if delete:
            await api.delete(ISVC_PATH)
            await tuner.tick()
            await reconciler.run(NS, NAME, logging.getLogger(__name__))
            out["deleted"] = await asyncio.to_thread(fetch)
    finally:
        await tuner.close()
        server.close()
    out["metrics"] = metrics
    return out


@pytest.fixture(scope="module")
def expositions() -> dict:
    return asyncio.run(_storm())


def test_a_remediation_is_counted_by_outcome_lever_and_direction(expositions):
    text = expositions["storm"]
    assert value(text, "kvpilot_operator_decisions_total", outcome="acted", reason="storm") == 1
    assert value(text, "kvpilot_operator_remediations_total", lever=RAISE_GPU_MEMORY, direction="up") == 1
    # Before the window filled: held for too little data; the tick after the change: the pod still
    # runs the old configuration; once it rolled over: the cooldown.
    assert value(text, "kvpilot_operator_decisions_total", outcome="held", reason="stale_data") == 4
    assert value(text, "kvpilot_operator_decisions_total", outcome="held", reason="mid_rollout") == 1
    assert value(text, "kvpilot_operator_decisions_total", outcome="held", reason="cooldown") == 2
    decided = sum(v for (name, _), v in samples(text).items() if name == "kvpilot_operator_decisions_total")
    assert decided == 8, "one decision per tick"
    # Created at 0 so that Prometheus sees their first increase.
    assert value(text, "kvpilot_operator_reverts_total", field="gpuMemoryUtilization") == 0
    assert value(text, "kvpilot_operator_remediations_total", lever="addReplica", direction="up") == 0


def test_effective_values_and_signals_follow_the_change(expositions):
    text = expositions["storm"]
    raised = value(text, "kvpilot_operator_effective_gpu_memory_utilization_ratio")
    assert raised is not None and 0.8 < raised <= 0.95
    assert value(text, "kvpilot_operator_effective_max_num_seqs") == 128
    # Unset in the spec: what the engine reports running with (EngineMetrics' model_config_info).
    assert value(text, "kvpilot_operator_effective_max_num_batched_tokens") == 8192
    assert value(text, "kvpilot_operator_effective_replicas") == 1
    assert value(text, "kvpilot_operator_effective_tensor_parallel_size") == 1
    assert value(text, "kvpilot_operator_signal_preemptions_per_second") == pytest.approx(10, rel=0.05)
    assert value(text, "kvpilot_operator_signal_kv_cache_usage_ratio") == pytest.approx(0.9)
    assert value(text, "kvpilot_operator_signal_requests_waiting") == 0
    assert value(text, "kvpilot_operator_remediation_mode", mode="Auto") == 1
    assert value(text, "kvpilot_operator_remediation_mode", mode="Off") == 0
    assert value(text, "kvpilot_operator_preemption_storm") == 1
    assert value(text, "kvpilot_operator_levers_exhausted") == 0


def test_scrapes_ticks_and_reconciles_are_counted(expositions):
    text = expositions["storm"]
    # Every tick but the one that found the pod on the outdated configuration (not scraped).
    assert value(text, "kvpilot_operator_scrapes_total") == 7
    assert value(text, "kvpilot_operator_scrape_errors_total", kind="connection") == 0
    all_samples = samples(text)
    assert all_samples[("kvpilot_operator_tick_duration_seconds_count", ())] == 8
    assert all_samples[("kvpilot_operator_last_tick_timestamp_seconds", ())] == START + 7
    # The first pass, then the re-render after the change.
    assert value(text, "kvpilot_operator_reconcile_duration_seconds_count") == 2


def test_a_pod_that_stops_answering_counts_a_scrape_error(expositions):
    text = expositions["down"]
    assert value(text, "kvpilot_operator_scrapes_total") == 8
    assert value(text, "kvpilot_operator_scrape_errors_total", kind="connection") == 1


def test_a_deleted_inferenceservice_leaves_no_series(expositions):
    assert value(expositions["down"], "kvpilot_operator_scrapes_total") is not None
    left = [key for key in samples(expositions["deleted"]) if ("inferenceservice", NAME) in key[1]]
    assert left == []
    assert samples(expositions["deleted"])[("kvpilot_operator_tick_duration_seconds_count", ())] == 10


def _settings(mode: str = "Auto", remediations: list | None = None):
    isvc = copy.deepcopy(BASE_ISVC)
    isvc["spec"]["remediation"] = {"mode": mode, "cooldown": "600s"}
    if remediations is not None:
        isvc["status"] = {"remediations": remediations}
    return resolve(isvc)


COMPLETE = MetricWindow(end=START, window_s=120, pods=("llama-0",), start=START - 120, full=True)
HELD = Decision(NONE, "held", RAISE_GPU_MEMORY, "gpuMemoryUtilization", 0.9, 0.95, "storm")
RECENT = [
    {
        "time": "2025-06-15T15:00:00Z",
        "lever": RAISE_GPU_MEMORY,
        "field": "gpuMemoryUtilization",
        "from": 0.85,
        "to": 0.9,
    }
]


@pytest.mark.parametrize(
    ("decision", "window", "mode", "history", "facts", "expected"),
    [
        (
            Decision(APPLY, "r", RAISE_GPU_MEMORY, "gpuMemoryUtilization", 0.9, 0.95, "storm"),
            COMPLETE,
            "Auto",
            None,
            {},
            ("acted", "storm"),
        ),
        (
            Decision(APPLY, "r", REVERT, "gpuMemoryUtilization", 0.95, 0.9),
            COMPLETE,
            "Auto",
            None,
            {},
            ("acted", "pods_failing"),
        ),
        (
            Decision(NONE, "r"),
            MetricWindow(end=START, window_s=120, problems=("no data",)),
            "Auto",
            None,
            {},
            ("held", "stale_data"),
        ),
        (
            Decision(NONE, "r"),
            MetricWindow(end=START, window_s=120, problems=("x",)),
            "Auto",
            None,
            {"bad_data": True},
            ("held", "bad_data"),
        ),
        (
            Decision(NONE, "r"),
            MetricWindow(end=START, window_s=120, problems=("x",)),
            "Auto",
            None,
            {"mid_rollout": True, "bad_data": True},
            ("held", "mid_rollout"),
        ),
        (
            Decision(NONE, "r"),
            MetricWindow(end=START, window_s=120, failing=(Failure("p", "OOMKilled"),)),
            "Auto",
            None,
            {},
            ("held", "pods_failing"),
        ),
        (
            Decision(NONE, "r", pressure="storm", exhausted=True),
            COMPLETE,
            "Auto",
            None,
            {},
            ("held", "at_limit"),
        ),
        (HELD, COMPLETE, "Off", None, {}, ("held", "mode_off")),
        (HELD, COMPLETE, "Auto", RECENT, {}, ("held", "cooldown")),
        (HELD, COMPLETE, "Auto", [], {}, ("held", "settling")),
        (Decision(NONE, "stable"), COMPLETE, "Auto", None, {}, ("stable", "none")),
    ],
)
def test_decisions_are_classified(decision, window, mode, history, facts, expected):
    now = 1_749_999_900.0  # 2025-06-15T15:05:00Z: 300 s after RECENT, within its 600 s cooldown
    assert classify_decision(decision, window, _settings(mode, history), now, **facts) == expected


def test_an_unknown_scrape_error_kind_is_refused():
    with pytest.raises(ValueError, match="unknown scrape error kind"):
        OperatorMetrics().observe_scrape(NS, NAME, "gremlins")


def test_a_bad_metrics_port_is_refused():
    with pytest.raises(ValueError, match="metrics port"):
        MetricsServer(OperatorMetrics().registry, 70000)
