"""``kvpilot operator --metrics-port``: the real operator process against the local Kubernetes API
(kmock) serves its own metrics for each InferenceService it handles, and drops them with it."""

from __future__ import annotations

import copy
import socket
import subprocess
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from kvpilot.operator.api import names
from tests.operator.conftest import BASE_ISVC, wait_for

NS, NAME = "team-m", "metered"
ISVC_PATH = f"/apis/{names.API_VERSION}/namespaces/{NS}/inferenceservices/{NAME}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _samples(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return {}
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _of(samples: dict, name: str) -> float | None:
    key = (name, (("inferenceservice", NAME), ("namespace", NS)))
    return samples.get(key)


def test_the_operator_serves_and_forgets_per_service_metrics(api, start_operator):
    port = _free_port()
    proc = start_operator([NS], ["--scrape-interval", "0.5", "--metrics-port", str(port)])
    url = f"http://127.0.0.1:{port}/metrics"
    wait_for(lambda: "operator metrics at" in proc.log, what="the metrics endpoint", timeout=30)
    isvc = copy.deepcopy(BASE_ISVC)
    isvc["metadata"] = {"name": NAME, "namespace": NS}
    api.create(f"/apis/{names.API_VERSION}/namespaces/{NS}/inferenceservices", isvc)
    seen = wait_for(
        lambda: (
            (s := _samples(url))
            and _of(s, "kvpilot_operator_reconcile_duration_seconds_count")
            and _of(s, "kvpilot_operator_effective_replicas") is not None
            and s
        ),
        what="metrics of the new InferenceService",
        timeout=30,
    )
    assert _of(seen, "kvpilot_operator_effective_replicas") == 2
    assert _of(seen, "kvpilot_operator_effective_max_num_seqs") == 128
    assert _of(seen, "kvpilot_operator_effective_gpu_memory_utilization_ratio") == 0.9
    # No engine pod exists (nothing runs Deployments here): every decision is held for want of data.
    held = seen.get(
        (
            "kvpilot_operator_decisions_total",
            (("inferenceservice", NAME), ("namespace", NS), ("outcome", "held"), ("reason", "stale_data")),
        )
    )
    assert held and held >= 1
    assert seen[("kvpilot_operator_tick_duration_seconds_count", ())] >= 1
    api.delete(ISVC_PATH)
    wait_for(
        lambda: (s := _samples(url)) and not [k for k in s if ("inferenceservice", NAME) in k[1]],
        what="the deleted InferenceService's series to go",
        timeout=30,
    )


def test_a_bad_metrics_port_is_a_usage_error():
    result = subprocess.run(
        [sys.executable, "-m", "kvpilot.operator", "operator", "-n", NS, "--metrics-port", "99999"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--metrics-port: must be a TCP port (1-65535), got 99999" in result.stderr
