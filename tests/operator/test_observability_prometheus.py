"""Our expositions through Prometheus' own tools: ``promtool check metrics`` on the operator's /metrics
after a remediation and on a live ``kvpilot serve`` after traffic; then a real Prometheus on 127.0.0.1
scrapes both, loads the chart's rules, and every PromQL expression of the dashboard and of the rules
returns at least one series through its HTTP query API.

An alert's expression is queried without its threshold comparisons (``> 0.97``, ``== 1``): the query
must find the series it judges, whether or not the alert would fire on this data (the promtool unit
tests in test_observability_chart decide firing).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from kvpilot.operator.observability import MetricsServer
from tests.operator.conftest import CHART, find_tool
from tests.operator.test_observability_chart import JOB, NAMESPACE, rule_groups
from tests.operator.test_operator_metrics import _storm
from tests.server.conftest import MODEL_NAME, ServerProcess

DASHBOARD = CHART / "dashboards" / "kvpilot-inferenceservice.json"
# What the dashboard's variables stand for in this test (the operator's storm is llm/llama).
VARIABLES = {"$namespace": "llm", "$inferenceservice": "llama", "$__rate_interval": "30s"}
# What promtool may report on the engine's /metrics, by design: vLLM's names (the ':' and a histogram
# called *_total) stay as they are, so dashboards written for vLLM work unchanged.
VLLM_BY_DESIGN = (
    re.compile(r"^vllm:\S+ metric names should not contain ':'$"),
    re.compile(r"^vllm:iteration_tokens_total non-counter metrics should not have \"_total\" suffix$"),
)


@pytest.fixture(scope="module")
def engine(tiny_llama, tmp_path_factory):
    """A live ``kvpilot serve`` on the tiny checkpoint, after a few requests (streamed and not)."""
    find_tool("promtool")  # every test of it needs promtool: skip (or fail under make) before starting
    log = tmp_path_factory.mktemp("engine") / "serve.log"
    server = ServerProcess(tiny_llama, log, ["--num-gpu-blocks-override", "64", "--seed", "0"])
    try:
        server.wait_ready()
        client = server.client()
        for i in range(3):
            client.completions.create(model=MODEL_NAME, prompt=f"hello {i}", max_tokens=8)
        for _ in client.completions.create(model=MODEL_NAME, prompt="stream", max_tokens=8, stream=True):
            pass
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def storm() -> dict:
    """The operator's metrics after a storm and its remediation (see test_operator_metrics)."""
    return asyncio.run(_storm(delete=False))


def promtool_check_metrics(text: str) -> tuple[int, list[str]]:
    result = subprocess.run(
        [find_tool("promtool"), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    lines = [line.strip() for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    return result.returncode, lines


def test_promtool_finds_nothing_in_the_operator_metrics(storm):
    assert "kvpilot_operator_remediations_total" in storm["storm"]
    code, problems = promtool_check_metrics(storm["storm"])
    assert (code, problems) == (0, [])


def test_promtool_check_metrics_can_fail():
    code, problems = promtool_check_metrics("# TYPE bad_seconds counter\nbad_seconds 1\n")
    assert code != 0 and problems


def _engine_problems(engine) -> list[str]:
    text = httpx.get(f"{engine.url}/metrics", timeout=10).text
    assert "vllm:time_to_first_token_seconds_count" in text
    return promtool_check_metrics(text)[1]


def test_promtool_reports_vllm_names_by_design_in_the_engine_metrics(engine):
    problems = _engine_problems(engine)
    assert any("vllm:num_preemptions_total" in p for p in problems), "the ':' of vLLM's names is reported"
    assert not any(p.startswith("process_") or p.startswith("python_") for p in problems)
    # Anything else is about a name of ours (checked below).
    others = [p for p in problems if not any(rule.match(p) for rule in VLLM_BY_DESIGN)]
    assert all(p.startswith("kvpilot") for p in others), others


def test_our_own_engine_metrics_follow_prometheus_naming(engine):
    """Names of ours alone follow Prometheus' rules; the old ':' name is only a deprecated alias."""
    from kvpilot.engine import metrics_names as m

    problems = _engine_problems(engine)
    ours = [p for p in problems if p.startswith("kvpilot") and p.split()[0] not in m.EXPORTED_ALIASES]
    assert ours == []
    text = httpx.get(f"{engine.url}/metrics", timeout=10).text
    assert f"{m.MODEL_CONFIG_INFO}{{" in text and f"{m.MODEL_CONFIG_INFO_ALIAS}{{" in text


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _without_thresholds(expr: str) -> str:
    """``expr`` with every comparison against a number removed (``a > 0.97`` -> ``a``)."""
    return re.sub(r"\s*(==|!=|>=|<=|>|<)\s*[0-9.]+(?![\w.])", "", expr)


def _dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queries += [a["expr"] for a in dashboard["annotations"]["list"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            # label_values(SELECTOR, label): the selector must find series.
            match = re.fullmatch(r"label_values\((.*), (\w+)\)", variable["query"]["query"])
            assert match, variable
            queries.append(match.group(1))
    out = []
    for query in queries:
        for name, value in VARIABLES.items():
            query = query.replace(name, value)
        assert "$" not in query, f"an unknown dashboard variable in {query}"
        out.append(_without_thresholds(query))
    return out


def _rule_queries() -> list[str]:
    return [_without_thresholds(r["expr"]) for g in rule_groups()["groups"] for r in g["rules"]]


def test_threshold_stripping():
    assert _without_thresholds('max(x{a="1"}) > 0.97') == 'max(x{a="1"})'
    assert _without_thresholds('up{j="o"} == 0\nor absent(up{j="o"})') == 'up{j="o"}\nor absent(up{j="o"})'
    assert _without_thresholds("clamp_max(a + on (n) (1 - b), 1) == 1") == "clamp_max(a + on (n) (1 - b), 1)"


@pytest.fixture(scope="module")
def prometheus(engine, storm, tmp_path_factory):
    """A Prometheus on 127.0.0.1 scraping the engine (as an InferenceService's ServiceMonitor target:
    labels namespace and service) and the operator (job and namespace of its ServiceMonitor, honoring
    the operator's own labels) every second, with the chart's rules loaded."""
    find_tool("prometheus")
    tmp = tmp_path_factory.mktemp("prometheus")
    server = MetricsServer(storm["metrics"].registry, 0, "127.0.0.1").start()
    engine_host = engine.url.removeprefix("http://")
    (tmp / "rules.yaml").write_text(yaml.safe_dump(rule_groups()))
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": ["rules.yaml"],
        "scrape_configs": [
            {
                "job_name": "llama",
                "static_configs": [
                    {"targets": [engine_host], "labels": {"namespace": "llm", "service": "llama"}}
                ],
            },
            {
                "job_name": JOB,
                "honor_labels": True,
                "static_configs": [
                    {"targets": [f"127.0.0.1:{server.port}"], "labels": {"namespace": NAMESPACE}}
                ],
            },
        ],
    }
    try:
        with run_prometheus(tmp, config) as url:
            yield url
    finally:
        server.close()


@contextlib.contextmanager
def run_prometheus(tmp: Path, config: dict) -> Iterator[str]:
    """A Prometheus server on a free 127.0.0.1 port with ``config`` (files it names relative to
    ``tmp``), its data in ``tmp``; yields its URL once ready, stops it afterwards."""
    binary = find_tool("prometheus")
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = _free_port()
    log = (tmp / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={tmp / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp / "prometheus.log").read_text()
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "prometheus did not become ready"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _query(url: str, expr: str) -> list[dict]:
    response = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    body = response.json()
    assert response.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


def _series_within(url: str, expr: str, timeout_s: float = 45.0) -> list[dict]:
    """The result of ``expr`` once it has a series (rates need a few scrapes first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = _query(url, expr)
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.5)


def test_both_targets_are_up(prometheus):
    up = _series_within(prometheus, "up == 1")
    deadline = time.monotonic() + 30
    while {s["metric"]["job"] for s in up} != {"llama", JOB} and time.monotonic() < deadline:
        time.sleep(0.5)
        up = _query(prometheus, "up == 1")
    assert {s["metric"]["job"] for s in up} == {"llama", JOB}


def test_the_rules_load_and_evaluate(prometheus):
    deadline = time.monotonic() + 30
    while True:
        groups = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        if rules and all(r["health"] == "ok" and r.get("lastEvaluation", "").startswith("20") for r in rules):
            break
        assert time.monotonic() < deadline, rules
        time.sleep(0.5)
    assert len(rules) == 5


@pytest.mark.parametrize("source", ["dashboard", "rules"])
def test_every_expression_returns_a_series(prometheus, source):
    queries = _dashboard_queries() if source == "dashboard" else _rule_queries()
    assert len(queries) >= (20 if source == "dashboard" else 5)
    empty = [q for q in queries if not _series_within(prometheus, q)]
    assert empty == []


def test_an_expression_on_a_missing_metric_returns_nothing(prometheus):
    """The check above can fail: a name no target exports finds no series."""
    _series_within(prometheus, "up == 1")
    assert _query(prometheus, 'sum(rate(vllm:no_such_metric_total{namespace="llm"}[30s]))') == []


def test_the_operator_series_keep_their_own_namespace(prometheus):
    series = _series_within(prometheus, "kvpilot_operator_effective_replicas")
    assert [(s["metric"]["namespace"], s["metric"]["inferenceservice"]) for s in series] == [("llm", "llama")]
    assert "exported_namespace" not in series[0]["metric"]
