"""``--metrics-source prometheus``: remediation reads the same signals by PromQL from a real Prometheus
that scrapes a scripted engine, and on the same storm decides what direct scrapes decide; a pod whose
series are gone counts as a failed scrape. Plus the source's input checks."""

from __future__ import annotations

import asyncio
import copy
import logging
import subprocess
import sys
import time

import pytest
from prometheus_client import generate_latest

from kvpilot.operator.api import names
from kvpilot.operator.api.rest import object_path
from kvpilot.operator.local.api import LocalApi
from kvpilot.operator.local.platform import prepare
from kvpilot.operator.observability import OperatorMetrics
from kvpilot.operator.observability.promsource import (
    METRIC_NAMES,
    PrometheusSource,
    PrometheusUrlError,
    _vector,
    check_url,
    selector,
)
from kvpilot.operator.options import OperatorOptions
from kvpilot.operator.reconcile.reconciler import Reconciler
from kvpilot.operator.remediation.loop import Autotuner
from kvpilot.operator.remediation.pods import Target
from tests.operator.conftest import BASE_ISVC, FAST_ROLLOUT_REMEDIATION, find_tool
from tests.operator.engine_metrics import EngineMetrics, ScriptedEngine
from tests.operator.test_observability_prometheus import run_prometheus
from tests.operator.test_operator_metrics import _pod, samples

NS, NAME = "llm", "llama"
ISVC_PATH = object_path(names.API_VERSION, names.KIND, NS, NAME)


def test_the_selector_quotes_names_and_pods():
    query = selector('we"ird', ["llama-0", "llama.1"])
    assert 'namespace="we\\"ird"' in query
    assert 'pod=~"llama\\\\-0|llama\\\\.1"' in query
    assert "vllm:num_preemptions_total" in query and "vllm:gpu_cache_usage_perc" in query
    assert "kvpilot_model_config_info" in METRIC_NAMES and "process_start_time_seconds" in METRIC_NAMES


@pytest.mark.parametrize("url", ["", "prometheus:9090", "ftp://x", "http://"])
def test_a_bad_url_is_refused(url):
    with pytest.raises(PrometheusUrlError, match="not an http"):
        check_url(url)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"status": "error", "error": "parse error at char 3"}, "parse error at char 3"),
        ({"status": "success", "data": {"resultType": "matrix", "result": []}}, "not a vector"),
        ({"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}}]}}, "malformed"),
    ],
)
def test_bad_answers_are_errors(body, message):
    with pytest.raises(ValueError, match=message):
        _vector(body)


def test_the_cli_needs_a_url_for_the_prometheus_source():
    def run(*args: str) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "kvpilot.operator", "operator", "-n", NS, *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)

    missing = run("--metrics-source", "prometheus")
    assert missing.returncode == 2 and "needs --prometheus-url" in missing.stderr
    stray = run("--prometheus-url", "http://prometheus:9090")
    assert stray.returncode == 2 and "only read with --metrics-source prometheus" in stray.stderr


def test_options_refuse_an_unknown_source():
    with pytest.raises(ValueError, match="metrics_source"):
        OperatorOptions(metrics_source="carrier-pigeon")
    with pytest.raises(ValueError, match="needs prometheus_url"):
        OperatorOptions(metrics_source="prometheus")


async def _service(engine: ScriptedEngine) -> tuple[LocalApi, Reconciler]:
    api = LocalApi()
    isvc = copy.deepcopy(BASE_ISVC)
    isvc["spec"]["replicas"] = 1
    isvc["spec"]["engine"] = {"maxNumSeqs": 128, "gpuMemoryUtilization": 0.8}
    isvc["spec"]["remediation"] = dict(FAST_ROLLOUT_REMEDIATION)
    await api.create(prepare(isvc, NS))

    async def no_events(*_):
        return None

    reconciler = Reconciler(api, no_events)
    await reconciler.run(NS, NAME, logging.getLogger(__name__))
    labels = api.read(object_path("apps/v1", "Deployment", NS, NAME))["spec"]["template"]["metadata"][
        "labels"
    ]
    api.put(object_path("v1", "Pod", NS, f"{NAME}-0"), _pod(0, dict(labels), engine.port))
    return api, reconciler


async def _race(url: str, engine: ScriptedEngine) -> dict:
    """Both sources on the same storm, ticking together in real time until both changed something."""
    tuners = {}
    for source in ("pods", "prometheus"):
        api, reconciler = await _service(engine)
        options = OperatorOptions(
            namespaces=(NS,), scrape_interval=1.0, metrics_source=source, prometheus_url=url
        )
        tuners[source] = (api, Autotuner(api, options, reconciler, metrics=OperatorMetrics()))
    first: dict[str, dict] = {}
    try:
        for _ in range(30):
            started = time.monotonic()
            for source, (api, tuner) in tuners.items():
                await tuner.tick()
                done = (api.read(ISVC_PATH).get("status") or {}).get("remediations") or []
                if done and source not in first:
                    first[source] = done[-1]
            if len(first) == 2:
                break
            await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
        # The engine stops answering: Prometheus marks its series stale, the source reports no series.
        engine.stop()
        _, prom_tuner = tuners["prometheus"]
        for _ in range(5):
            await asyncio.sleep(1.0)
            await prom_tuner.tick()
        text = generate_latest(prom_tuner.metrics.registry).decode()
    finally:
        for _, tuner in tuners.values():
            await tuner.close()
    return {"first": first, "metrics": text, "source": type(prom_tuner.scraper).__name__}


def test_the_prometheus_source_decides_as_direct_scrapes(tmp_path):
    find_tool("prometheus")
    engine = ScriptedEngine(EngineMetrics(max_num_seqs=128).set(kv=0.9, waiting=0, running=10), rate=10.0)
    config = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "engines",
                "static_configs": [
                    {"targets": [f"127.0.0.1:{engine.port}"], "labels": {"namespace": NS, "pod": f"{NAME}-0"}}
                ],
            }
        ],
    }
    try:
        with run_prometheus(tmp_path, config) as url:
            out = asyncio.run(_race(url, engine))
    finally:
        engine.stop()
    assert out["source"] == PrometheusSource.__name__
    first = out["first"]
    assert set(first) == {"pods", "prometheus"}, first
    same = ("lever", "field", "from", "to")
    assert {k: first["prometheus"][k] for k in same} == {k: first["pods"][k] for k in same}
    assert first["prometheus"]["lever"] == "raiseGpuMemoryUtilization"
    label = (("inferenceservice", NAME), ("kind", "connection"), ("namespace", NS))
    assert samples(out["metrics"])[("kvpilot_operator_scrape_errors_total", label)] >= 1


def test_an_unreachable_prometheus_is_a_failed_scrape():
    source = PrometheusSource("http://127.0.0.1:9", timeout_s=2.0)
    target = Target(NS, f"{NAME}-0", "uid-0", "http://127.0.0.1:1/metrics")

    async def run():
        try:
            return await source.scrape([target])
        finally:
            await source.close()

    (result,) = asyncio.run(run())
    assert result.text is None and result.kind == "connection" and "Prometheus" in result.error


class _Answer:
    def __init__(self, body: dict) -> None:
        self.status, self.body = 200, body

    async def __aenter__(self) -> _Answer:
        return self

    async def __aexit__(self, *exc) -> None:
        return None

    async def json(self, content_type=None) -> dict:
        return self.body


class _FilteringPrometheus:
    """Answers an instant query as Prometheus would over one pod's exposition: only the series whose
    ``__name__`` the query's selector matches, with the pod's target labels added."""

    def __init__(self, text: str, pod: str) -> None:
        from prometheus_client.parser import text_string_to_metric_families

        self.series = [
            ({"__name__": s.name, **s.labels, "namespace": NS, "pod": pod}, s.value)
            for family in text_string_to_metric_families(text)
            for s in family.samples
        ]

    def get(self, url: str, params: dict) -> _Answer:
        import re

        names_re = re.search(r'__name__=~"((?:[^"\\]|\\.)*)"', params["query"]).group(1)
        pattern = re.compile(names_re.encode().decode("unicode_escape"))
        result = [
            {"metric": labels, "value": [1000.0, repr(value)]}
            for labels, value in self.series
            if pattern.fullmatch(labels["__name__"])
        ]
        return _Answer({"status": "success", "data": {"resultType": "vector", "result": result}})


def test_the_prometheus_source_carries_the_latency_histograms_and_token_sums():
    """The demand rule that sees queues reads the TTFT and queue-time histograms, the live relief the
    request-token sums: the query must ask Prometheus for them, or that source never sees them."""
    from kvpilot.operator.remediation.metrics import parse_scrape

    engine = EngineMetrics(max_num_seqs=8, latency=True).set(kv=0.3, waiting=12, running=4)
    engine.serve(ttft_s=4.0, queue_s=3.0, count=20)
    pod = f"{NAME}-0"
    source = PrometheusSource("http://prometheus:9090")
    source._session = _FilteringPrometheus(engine.text(), pod)
    (result,) = asyncio.run(source._batch(NS, [Target(NS, pod, "uid-0", "http://10.0.0.1:8000")]))
    scrape = parse_scrape(result.text, result.time)
    direct = parse_scrape(engine.text(), result.time)
    assert direct.ttft is not None and direct.queue_time is not None
    assert scrape.ttft == direct.ttft and scrape.queue_time == direct.queue_time
    assert scrape.request_tokens == direct.request_tokens
    assert scrape.requests_finished == direct.requests_finished
