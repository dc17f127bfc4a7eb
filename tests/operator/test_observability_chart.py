"""The chart's observability: the operator metrics Service and ServiceMonitor, the PrometheusRule (checked
and unit-tested with promtool: each alert fires and resolves on synthetic series) and the Grafana
dashboard ConfigMap; with all of it on, ``helm lint --strict`` is clean and the core objects are valid."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import kubernetes_validate
import yaml

from tests.operator.conftest import CHART, K8S_VERSION, find_tool

ON = [
    "--set", "metrics.serviceMonitor.enabled=true",
    "--set", "metrics.serviceMonitor.labels.release=kube-prometheus-stack",
    "--set", "prometheusRule.enabled=true",
    "--set", "prometheusRule.additionalAlertLabels.team=ml-platform",
    "--set", "grafanaDashboard.enabled=true",
    "--set", "grafanaDashboard.annotations.grafana_folder=LLM",
]  # fmt: skip
RELEASE, NAMESPACE = "kvp", "kvpilot-system"
JOB = "kvp-kvpilot-metrics"  # the metrics Service's name: the job a ServiceMonitor's targets get
DASHBOARD = CHART / "dashboards" / "kvpilot-inferenceservice.json"
ALERTS = {
    "KvpilotPreemptionStormUnremediated",
    "KvpilotKVCacheSaturated",
    "KvpilotRemediationReverted",
    "KvpilotScrapesFailing",
    "KvpilotOperatorDown",
}


def helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([find_tool("helm"), *args], capture_output=True, text=True, timeout=120)


def render(*extra: str) -> list[dict]:
    result = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *extra)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def one(objects: list[dict], kind: str) -> dict:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}"
    return found[0]


def rule_groups(*extra: str) -> dict:
    """The rendered PrometheusRule's spec: a Prometheus rule file."""
    return one(render(*ON, *extra), "PrometheusRule")["spec"]


def test_lint_strict_with_everything_on():
    result = helm("lint", "--strict", str(CHART), *ON)
    assert result.returncode == 0, result.stdout + result.stderr


def test_core_objects_are_valid_kubernetes_with_everything_on():
    objects = render(*ON)
    kinds = [o["kind"] for o in objects]
    assert {"ServiceMonitor", "PrometheusRule", "ConfigMap"} <= set(kinds)
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # Prometheus Operator kinds: checked below and by promtool
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)  # raises ValidationError


def test_the_metrics_service_reaches_the_operator_port():
    objects = render(*ON, "--set", "metrics.port=9300")
    deployment = one(objects, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert "--metrics-port=9300" in container["args"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["metrics"] == 9300
    service = [o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == JOB]
    assert len(service) == 1
    assert service[0]["spec"]["ports"] == [
        {"name": "metrics", "port": 9300, "targetPort": "metrics", "protocol": "TCP"}
    ]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service[0]["spec"]["selector"].items() <= pod_labels.items()
    monitor = one(objects, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service[0]["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    # The operator's own namespace/inferenceservice labels must survive the scrape.
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True


def test_everything_off_renders_none_of_it():
    objects = render("--set", "metrics.enabled=false")
    assert not [o for o in objects if o["kind"] in ("ServiceMonitor", "PrometheusRule", "ConfigMap")]
    assert not [o for o in objects if o["kind"] == "Service"]
    (container,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert not [a for a in container["args"] if a.startswith("--metrics-port")]


def test_the_dashboard_configmap_carries_the_sidecar_label_and_the_json():
    configmap = one(render(*ON, "--set", "grafanaDashboard.namespace=monitoring"), "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["namespace"] == "monitoring"
    assert configmap["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    assert json.loads(configmap["data"]["kvpilot-inferenceservice.json"]) == json.loads(DASHBOARD.read_text())


def test_dashboard_rows_and_templating():
    dashboard = json.loads(DASHBOARD.read_text())
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == ["Traffic", "Latency", "Capacity", "Operator"]
    variables = [v["name"] for v in dashboard["templating"]["list"]]
    assert variables == ["datasource", "namespace", "inferenceservice"]
    for panel in (p for p in dashboard["panels"] if p["type"] != "row"):
        assert panel["description"], panel["title"]
        for target in panel["targets"]:
            # Every query is scoped to the selected InferenceService.
            assert '"$namespace"' in target["expr"] and '"$inferenceservice"' in target["expr"], target


def test_every_alert_has_summary_description_runbook_and_for():
    groups = rule_groups()
    rules = [r for g in groups["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} == ALERTS
    readme = (CHART / "README.md").read_text()
    anchors = {m.lower() for m in re.findall(r"^#+ (Kvpilot\w+)", readme, re.MULTILINE)}
    for rule in rules:
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        assert rule["annotations"]["runbook_url"].endswith("#" + rule["alert"].lower())
        assert rule["alert"].lower() in anchors, f"no runbook section for {rule['alert']} in the README"
        assert re.fullmatch(r"[0-9]+[smh]", rule["for"]), rule
        assert rule["labels"]["team"] == "ml-platform"
        assert rule["labels"]["severity"] in ("warning", "critical")


def test_values_schema_rejects_bad_observability_values(tmp_path):
    for values, field in (
        ({"metrics": {"enabled": True, "port": 70000}}, "port"),
        ({"prometheusRule": {"kvCacheUsageThreshold": 1.5}}, "kvCacheUsageThreshold"),
        ({"prometheusRule": {"for": {"operatorDown": "five minutes"}}}, "operatorDown"),
        ({"grafanaDashboard": {"colour": "blue"}}, "colour"),
    ):
        path = tmp_path / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        result = helm("template", RELEASE, str(CHART), "-f", str(path))
        assert result.returncode != 0 and "values don't meet the specifications" in result.stderr, values
        assert field in result.stderr, result.stderr


def _write_rules(tmp_path: Path) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rule_groups()))
    return path


def test_promtool_check_rules_is_clean(tmp_path):
    result = subprocess.run(
        [find_tool("promtool"), "check", "rules", str(_write_rules(tmp_path))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 5 rules found" in result.stdout


S = 'namespace="llm", inferenceservice="llama"'


def _annotations(alert: str, labels: dict, value: str = "") -> dict:
    """The rendered rule's annotations of ``alert`` as Prometheus expands them for ``labels`` (and
    ``$value`` humanized as ``value``)."""
    (rule,) = [r for g in rule_groups()["groups"] for r in g["rules"] if r["alert"] == alert]
    out = {}
    for key, text in rule["annotations"].items():
        text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], text)
        out[key] = text.replace("{{ $value | humanizePercentage }}", value)
    return out


def _case(series: list[tuple[str, str]], alert: str, eval_times: dict[str, list[dict]]) -> dict:
    """A promtool test: ``series`` (selector, values) at a 1m interval; for each eval time, the alerts
    of ``alert`` expected then (an empty list: not firing)."""
    for expected in eval_times.values():
        for entry in expected:
            value = entry.pop("value", "")
            entry["exp_annotations"] = _annotations(alert, entry["exp_labels"], value)
    return {
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in series],
        "alert_rule_test": [
            {"eval_time": at, "alertname": alert, "exp_alerts": expected}
            for at, expected in eval_times.items()
        ],
    }


def _labels(alert_labels: dict) -> dict:
    return {"team": "ml-platform", **alert_labels}


def _alert_tests() -> list[dict]:
    llama = {"namespace": "llm", "inferenceservice": "llama"}
    storm_labels = _labels({"severity": "critical", **llama})
    return [
        # A storm with every lever at its limit for 20 minutes, then the storm ends.
        _case(
            [
                (f"kvpilot_operator_preemption_storm{{{S}}}", "1x20 0x10"),
                (f"kvpilot_operator_levers_exhausted{{{S}}}", "1x30"),
                (f'kvpilot_operator_remediation_mode{{{S}, mode="Auto"}}', "1x30"),
            ],
            "KvpilotPreemptionStormUnremediated",
            {"5m": [], "15m": [{"exp_labels": storm_labels}], "25m": []},
        ),
        # Mode Recommend (Auto is 0) and a storm: nothing will change by itself.
        _case(
            [
                (f"kvpilot_operator_preemption_storm{{{S}}}", "1x30"),
                (f"kvpilot_operator_levers_exhausted{{{S}}}", "0x30"),
                (f'kvpilot_operator_remediation_mode{{{S}, mode="Auto"}}', "0x30"),
            ],
            "KvpilotPreemptionStormUnremediated",
            {"15m": [{"exp_labels": storm_labels}]},
        ),
        # A storm in Auto with levers left: remediation acts, no alert.
        _case(
            [
                (f"kvpilot_operator_preemption_storm{{{S}}}", "1x30"),
                (f"kvpilot_operator_levers_exhausted{{{S}}}", "0x30"),
                (f'kvpilot_operator_remediation_mode{{{S}, mode="Auto"}}', "1x30"),
            ],
            "KvpilotPreemptionStormUnremediated",
            {"20m": []},
        ),
        # KV usage at 99% for 20 minutes, then 60%.
        _case(
            [(f"kvpilot_operator_signal_kv_cache_usage_ratio{{{S}}}", "0.99x20 0.6x10")],
            "KvpilotKVCacheSaturated",
            {
                "10m": [],
                "18m": [{"exp_labels": _labels({"severity": "warning", **llama}), "value": "99%"}],
                "25m": [],
            },
        ),
        # One revert at minute 5: fires at once, resolves once it is older than 30 minutes.
        _case(
            [(f'kvpilot_operator_reverts_total{{{S}, field="maxNumSeqs"}}', "0x5 1x40")],
            "KvpilotRemediationReverted",
            {
                "3m": [],
                "6m": [{"exp_labels": _labels({"severity": "warning", "field": "maxNumSeqs", **llama})}],
                "40m": [],
            },
        ),
        # 4 scrapes a minute, all failing from minute 5 to 25, then healthy again.
        _case(
            [
                (f"kvpilot_operator_scrapes_total{{{S}}}", "0+4x40"),
                (f'kvpilot_operator_scrape_errors_total{{{S}, kind="timeout"}}', "0x5 0+4x20 80x15"),
            ],
            "KvpilotScrapesFailing",
            {
                "8m": [],
                "20m": [{"exp_labels": _labels({"severity": "warning", **llama}), "value": "100%"}],
                "35m": [],
            },
        ),
        # Two replicas, one a standby that serves no metrics; the leader answers for 10 minutes, then
        # neither does.
        _case(
            [
                (f'up{{job="{JOB}", namespace="{NAMESPACE}", instance="a"}}', "1x10 0x20"),
                (f'up{{job="{JOB}", namespace="{NAMESPACE}", instance="b"}}', "0x30"),
            ],
            "KvpilotOperatorDown",
            {
                "8m": [],
                "18m": [
                    {"exp_labels": _labels({"severity": "critical", "job": JOB, "namespace": NAMESPACE})}
                ],
            },
        ),
        # No target at all (the ServiceMonitor not selected): down too.
        _case(
            [('up{job="something-else", namespace="monitoring"}', "1x30")],
            "KvpilotOperatorDown",
            {"10m": [{"exp_labels": _labels({"severity": "critical", "job": JOB, "namespace": NAMESPACE})}]},
        ),
    ]


def test_promtool_unit_tests_fire_and_resolve_each_alert(tmp_path):
    rules = _write_rules(tmp_path)
    tests = _alert_tests()
    assert {t["alert_rule_test"][0]["alertname"] for t in tests} == ALERTS
    spec = tmp_path / "alerts_test.yaml"
    spec.write_text(yaml.safe_dump({"rule_files": [rules.name], "evaluation_interval": "1m", "tests": tests}))
    result = subprocess.run(
        [find_tool("promtool"), "test", "rules", spec.name],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_can_fail(tmp_path):
    """The same harness reports an alert expected but not firing (so the test above can fail)."""
    rules = _write_rules(tmp_path)
    wrong = _case(
        [(f"kvpilot_operator_signal_kv_cache_usage_ratio{{{S}}}", "0.5x30")],
        "KvpilotKVCacheSaturated",
        {
            "20m": [
                {
                    "exp_labels": _labels(
                        {"severity": "warning", "namespace": "llm", "inferenceservice": "llama"}
                    )
                }
            ]
        },
    )
    spec = tmp_path / "alerts_test.yaml"
    spec.write_text(
        yaml.safe_dump({"rule_files": [rules.name], "evaluation_interval": "1m", "tests": [wrong]})
    )
    result = subprocess.run(
        [find_tool("promtool"), "test", "rules", spec.name],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode != 0 and "KvpilotKVCacheSaturated" in result.stdout + result.stderr
