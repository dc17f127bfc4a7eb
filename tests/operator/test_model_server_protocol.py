"""kvpilot's engine against the metrics an endpoint picker reads: the Gateway API Inference
Extension's model server protocol (v1.6.2, vendored in fixtures/), its vLLM column, checked against
the engine's own /metrics exposition (the Prometheus exporter ``kvpilot serve`` runs)."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.engine import metrics_names
from kvpilot.operator.render.routing import DEFAULT_EPP_IMAGE
from tests.server.test_metrics_unit import make_logger

PROTOCOL = Path(__file__).with_name("fixtures") / "gie-v1.6.2-model-server-protocol.md"
# What the protocol names that the engine does not export, and why (the endpoint picker then runs
# without it: the LoRA affinity scorer has nothing to score, the others are unaffected).
NOT_EXPORTED = {"vllm:lora_requests_info": "kvpilot serves no LoRA adapters"}


def documented() -> dict[str, set[str]]:
    """metric name -> the labels the protocol reads from it, from the vLLM column of its tables and
    the LoRA section."""
    wanted: dict[str, set[str]] = {}
    for line in PROTOCOL.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[3].count("`"):
            continue
        vllm = cells[3]
        named = re.match(r"name: `([^`]+)`, label name: `([^`]+)`", vllm)
        if named:
            wanted.setdefault(named.group(1), set()).add(named.group(2))
        else:
            wanted.setdefault(vllm.strip("`"), set())
    lora = re.search(r"Metric name implemented in vLLM: `([^`]+)`", PROTOCOL.read_text())
    assert lora is not None
    wanted[lora.group(1)] = {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}
    return wanted


def exported() -> dict[str, set[str]]:
    """metric family name -> its label names, as the engine's exporter renders /metrics."""
    text = generate_latest(make_logger().registry).decode()
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        labels = set().union(*(sample.labels for sample in family.samples)) if family.samples else set()
        # prometheus-client reports a gauge's family under its own name (an info gauge's too).
        out[family.name] = labels
    return out


def test_the_vendored_protocol_is_the_one_the_default_endpoint_picker_speaks():
    assert DEFAULT_EPP_IMAGE.endswith(":v1.6.2") and "v1.6.2" in PROTOCOL.name
    assert "sigs.k8s.io/gateway-api-inference-extension v1.6.2" in PROTOCOL.read_text()


def test_the_engine_exports_every_metric_the_endpoint_picker_reads():
    wanted, have = documented(), exported()
    assert {
        metrics_names.NUM_REQUESTS_WAITING,
        metrics_names.NUM_REQUESTS_RUNNING,
        metrics_names.KV_CACHE_USAGE_PERC,
        metrics_names.CACHE_CONFIG_INFO,
    } <= set(wanted), "the table parsed"
    missing = {name for name in wanted if name not in have}
    assert missing == set(NOT_EXPORTED), missing
    for name, labels in wanted.items():
        if name in have:
            assert labels <= have[name], f"{name}: the protocol reads labels {sorted(labels - have[name])}"
    assert {"block_size", "num_gpu_blocks"} <= wanted[metrics_names.CACHE_CONFIG_INFO]
