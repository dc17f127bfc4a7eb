"""One reconcile pass, called directly against the local API (no kopf): the paths that need no
operator process — ServiceMonitors with and without their CRD or RBAC, stale status writes."""

from __future__ import annotations

import asyncio
import copy

import kmock
import kopf
import pytest

from kvpilot.operator.api import names
from kvpilot.operator.api.rest import ApiError, object_path
from kvpilot.operator.api.settings import resolve
from kvpilot.operator.kube import KubeClient
from kvpilot.operator.reconcile.drift import drifted
from kvpilot.operator.reconcile.reconciler import reconcile
from tests.operator.conftest import BASE_ISVC

NS = "direct"
MONITORS = f"/apis/monitoring.coreos.com/v1/namespaces/{NS}/servicemonitors"


def run(api, coro_fn):
    """Run ``coro_fn(kube)`` with a client logged in to the local API; close the client after."""

    async def main():
        kube = KubeClient()
        kube.use(kopf.ConnectionInfo(server=api.url))
        try:
            return await coro_fn(kube)
        finally:
            await kube.close()

    return asyncio.run(main())


def create(api, name: str, **spec) -> dict:
    isvc = copy.deepcopy(BASE_ISVC)
    isvc["metadata"] = {"name": name, "namespace": NS}
    isvc["spec"].update(spec)
    return api.create(f"/apis/{names.API_VERSION}/namespaces/{NS}/inferenceservices", isvc)


def fresh(api, name: str) -> dict:
    return api.get(object_path(names.API_VERSION, names.KIND, NS, name))


def reconcile_once(api, name: str, **kwargs):
    events: list[tuple[str, str, str]] = []

    async def go(kube):
        return await reconcile(kube, resolve(fresh(api, name)), lambda *e: events.append(e), **kwargs)

    return run(api, go), events


MONITORING = {"serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}}}


def test_service_monitor_needs_the_operator_flag(api):
    create(api, "no-flag", monitoring=MONITORING)
    before = len(api.writes)
    outcome, events = reconcile_once(api, "no-flag", service_monitors=False)
    assert [w for w in api.writes[before:] if "servicemonitors" in w[1]] == []
    assert not any(resource == "servicemonitors" for _, resource, _ in api.verbs)
    assert "--service-monitors" in outcome.warnings[0]
    assert ("Warning", "ServiceMonitorUnavailable", outcome.warnings[0]) in events
    assert len(outcome.written) == 4  # Deployment, Service, PDB, live-config ConfigMap
    _, quiet = reconcile_once(api, "no-flag", service_monitors=False, announce=False)
    assert quiet == [], "periodic passes do not repeat the warning"


def test_service_monitor_without_its_crd_is_skipped(api):
    create(api, "no-crd", monitoring=MONITORING)
    outcome, _ = reconcile_once(api, "no-crd", service_monitors=True)
    assert sorted(outcome.written) == [
        "Created ConfigMap no-crd-live-config",
        "Created Deployment no-crd",
        "Created PodDisruptionBudget no-crd",
        "Created Service no-crd",
    ]
    assert fresh(api, "no-crd")["status"]["phase"] == "Pending"


@pytest.fixture
def monitoring_crd(api):
    resource = "monitoring.coreos.com/v1/servicemonitors"
    api.server.resources[resource] = kmock.ResourceInfo(kind="ServiceMonitor", namespaced=True)
    yield
    del api.server.resources[resource]


def test_service_monitor_is_created_and_pruned(api, monitoring_crd):
    create(api, "monitored", monitoring=MONITORING)
    outcome, _ = reconcile_once(api, "monitored", service_monitors=True)
    assert "Created ServiceMonitor monitored" in outcome.written
    monitor = api.get(f"{MONITORS}/monitored")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert monitor["metadata"]["ownerReferences"][0]["uid"] == fresh(api, "monitored")["metadata"]["uid"]
    again, _ = reconcile_once(api, "monitored", service_monitors=True)
    assert again.written == [] and again.status_written is False
    path = object_path(names.API_VERSION, names.KIND, NS, "monitored")
    api.merge_patch(path, {"spec": {"monitoring": {"serviceMonitor": {"enabled": False}}}})
    pruned, _ = reconcile_once(api, "monitored", service_monitors=True)
    assert pruned.written == ["Deleted ServiceMonitor monitored"]
    assert api.get(f"{MONITORS}/monitored") is None


def test_stale_status_write_is_refused(api):
    create(api, "stale")
    stale = fresh(api, "stale")
    path = object_path(names.API_VERSION, names.KIND, NS, "stale")
    api.merge_patch(path + "/status", {"status": {"signals": {"kvCacheUsage": 0.5}}})

    async def go(kube):
        return await reconcile(kube, resolve(stale), lambda *e: None)

    with pytest.raises(ApiError) as raised:
        run(api, go)
    assert raised.value.status == 409
    outcome, _ = reconcile_once(api, "stale")
    assert outcome.status_written is True
    assert fresh(api, "stale")["status"]["signals"] == {"kvCacheUsage": 0.5}, "foreign status fields survive"


def pod_template(image: str = "a", args: tuple = ("--p",), replicas=2, **extra) -> dict:
    container = {"image": image, "args": list(args), "resources": {"limits": {"cpu": "0.5"}}, **extra}
    spec = {"replicas": replicas, "template": {"c": [container]}}
    return {"spec": {key: value for key, value in spec.items() if value is not None}}


@pytest.mark.parametrize(
    ("live", "where"),
    [
        (pod_template(terminationMessagePath="/dev/termination-log"), None),  # server defaults: not drift
        (pod_template(image="b"), "spec.template.c[0].image"),
        (pod_template(args=("--p", "--q")), "spec.template.c[0].args"),
        (pod_template(replicas=3), "spec.replicas"),
        (pod_template(replicas=None), "spec.replicas"),
        (pod_template(resources={"limits": {"cpu": "500m"}}), None),  # the same quantity, canonical form
        (pod_template(resources={"limits": {"cpu": "1"}}), "spec.template.c[0].resources.limits.cpu"),
    ],
)
def test_drifted_names_the_first_rendered_field_that_differs(live, where):
    assert drifted(pod_template(), live) == where
    assert drifted({"on": True}, {"on": 1}) == "on"


def keyed_template(
    env: list, containers_extra: list = (), ports=({"name": "http", "containerPort": 8000},)
) -> dict:
    engine = {"name": "engine", "args": ["--p"], "env": env, "ports": list(ports)}
    return {"spec": {"template": {"spec": {"containers": [engine, *containers_extra]}}}}


SIDECAR = {"name": "mesh-proxy", "image": "proxy:1"}
ENV = [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]


@pytest.mark.parametrize(
    ("live", "where"),
    [
        # Another manager's env var and sidecar merge in beside the operator's entries (the API
        # server merges these lists by name), and the API server fills in the port's protocol.
        (keyed_template([*ENV, {"name": "INJECTED", "value": "1"}], [SIDECAR]), None),
        (keyed_template([ENV[1], {"name": "INJECTED"}, ENV[0]], [SIDECAR]), None),
        (
            {
                "spec": {
                    "template": {
                        "spec": {
                            "containers": [
                                SIDECAR,
                                keyed_template(ENV)["spec"]["template"]["spec"]["containers"][0],
                            ]
                        }
                    }
                }
            },
            None,
        ),
        (keyed_template(ENV, ports=({"name": "http", "containerPort": 8000, "protocol": "TCP"},)), None),
        (
            keyed_template([ENV[0], {"name": "B", "value": "3"}]),
            "spec.template.spec.containers[engine].env[B].value",
        ),
        (keyed_template([ENV[0]]), "spec.template.spec.containers[engine].env[B]"),
        (
            keyed_template(ENV, ports=({"name": "http", "containerPort": 8000, "protocol": "UDP"},)),
            "spec.template.spec.containers[engine].ports[8000/TCP]",
        ),
        (
            {"spec": {"template": {"spec": {"containers": [SIDECAR]}}}},
            "spec.template.spec.containers[engine]",
        ),
    ],
)
def test_entries_of_merge_keyed_lists_are_matched_by_key(live, where):
    assert drifted(keyed_template(ENV), live) == where


def test_atomic_lists_still_drift_on_an_extra_entry():
    assert drifted({"args": ["--p"]}, {"args": ["--p", "--q"]}) == "args"
    assert (
        drifted({"tolerations": [{"key": "gpu"}]}, {"tolerations": [{"key": "gpu"}, {"key": "x"}]})
        == "tolerations"
    )
