"""The chart's NetworkPolicies select exactly the pods the operator's builders and the chart render,
on the port the engines listen on."""

from __future__ import annotations

from kvpilot.operator.api import names
from kvpilot.operator.api.settings import resolve
from kvpilot.operator.render.builders import build_deployment
from tests.operator.test_chart import by_kind, render

ON = ("--set", "networkPolicy.enabled=true")


def matches(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels and In/NotIn/Exists/DoesNotExist expressions) against labels."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def engine_pod(make_isvc, name: str, namespace: str) -> tuple[dict, dict]:
    """(labels, container) of the engine pods the operator renders for an InferenceService."""
    isvc = make_isvc(
        {"metadata.name": name, "metadata.namespace": namespace, "spec.pod.labels": {"team": "x"}}
    )
    template = build_deployment(resolve(isvc))["spec"]["template"]
    return template["metadata"]["labels"], template["spec"]["containers"][0]


def policies(*extra: str) -> dict[tuple[str, str], dict]:
    objects = render(*ON, *extra)
    return {
        (p["metadata"]["namespace"], p["metadata"]["name"]): p
        for p in by_kind(objects).get("NetworkPolicy", [])
    }


def operator_pod_labels(*extra: str) -> dict:
    (deployment,) = by_kind(render(*ON, *extra))["Deployment"]
    return deployment["spec"]["template"]["metadata"]["labels"]


def namespace_labels(namespace: str) -> dict:
    return {"kubernetes.io/metadata.name": namespace}  # set on every namespace by the API server


def test_operator_egress_reaches_engine_pods_dns_and_the_api(make_isvc):
    scoped = ("--set", "operator.watchNamespaces={llm,batch}")
    egress_policy = policies(*scoped)[("kvpilot-system", "kvp-kvpilot-operator")]
    spec = egress_policy["spec"]
    assert spec["policyTypes"] == ["Egress"]
    assert matches(spec["podSelector"], operator_pod_labels(*scoped))
    rule_ports = [{(p["port"], p["protocol"]) for p in rule["ports"]} for rule in spec["egress"]]
    assert {(53, "UDP"), (53, "TCP")} in rule_ports
    assert {(443, "TCP"), (6443, "TCP")} in rule_ports
    (engine_rule,) = [
        r
        for r in spec["egress"]
        if (names.HTTP_PORT, "TCP") in {(p["port"], p["protocol"]) for p in r["ports"]}
    ]
    (peer,) = engine_rule["to"]
    for name, namespace in [("llama", "llm"), ("mistral", "batch")]:
        labels, container = engine_pod(make_isvc, name, namespace)
        assert container["ports"][0]["containerPort"] == names.HTTP_PORT
        assert matches(peer["podSelector"], labels) and matches(
            peer["namespaceSelector"], namespace_labels(namespace)
        )
    labels, _ = engine_pod(make_isvc, "llama", "other")
    assert not matches(peer["namespaceSelector"], namespace_labels("other"))
    # A cluster-wide operator reaches engines in every namespace.
    cluster_wide = policies()[("kvpilot-system", "kvp-kvpilot-operator")]
    (peer,) = [r for r in cluster_wide["spec"]["egress"] if "to" in r and "podSelector" in r["to"][0]][0][
        "to"
    ]
    assert peer["namespaceSelector"] == {}


def test_engine_ingress_admits_the_operator_clients_and_prometheus(make_isvc):
    found = policies("--set", "operator.watchNamespaces={llm}")
    policy = found[("llm", "kvp-kvpilot-engine")]["spec"]
    labels, _ = engine_pod(make_isvc, "llama", "llm")
    assert policy["policyTypes"] == ["Ingress"] and matches(policy["podSelector"], labels)
    # It selects no operator pod (whose egress policy is separate).
    assert not matches(policy["podSelector"], operator_pod_labels())
    assert all(p["ports"] == [{"port": names.HTTP_PORT, "protocol": "TCP"}] for p in policy["ingress"])
    operator_rule, clients_rule, prometheus_rule = policy["ingress"]
    (peer,) = operator_rule["from"]
    assert matches(peer["podSelector"], operator_pod_labels("--set", "operator.watchNamespaces={llm}"))
    assert matches(peer["namespaceSelector"], namespace_labels("kvpilot-system"))
    assert not matches(peer["namespaceSelector"], namespace_labels("llm"))
    assert clients_rule["from"] == [{"podSelector": {}}]
    (prometheus,) = prometheus_rule["from"]
    assert matches(prometheus["namespaceSelector"], namespace_labels("monitoring"))


def test_engine_policies_go_to_the_engine_namespaces():
    assert [k for k in policies() if k[1].endswith("-engine")] == []  # cluster-wide: none named
    named = policies("--set", "networkPolicy.engine.namespaces={a,b}")
    assert sorted(k[0] for k in named if k[1].endswith("-engine")) == ["a", "b"]
    scoped = policies("--set", "operator.watchNamespaces={llm,batch}")
    assert sorted(k[0] for k in scoped if k[1].endswith("-engine")) == ["batch", "llm"]
    assert by_kind(render()).get("NetworkPolicy") is None  # off by default
