"""Two operator processes with --leader-elect against the local API server: one leads, the other
stands by writing nothing; killed, the leader is replaced within the lease time (counted in the
standby's attempts) and the new leader writes nothing that was already written."""

from __future__ import annotations

import math
import urllib.request

import pytest

from tests.operator.conftest import wait_for
from tests.operator.test_chart import by_kind, render
from tests.operator.test_operator_kmock import child_path, free_port, new_isvc

NS = "team-a"
LEASE_NS = "kvpilot-system"
LEASE = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NS}/leases/kvpilot-operator"
DURATION, DEADLINE, RETRY = 3.0, 2.0, 0.25


def elected(identity: str, port: int) -> list[str]:
    return [
        "--resync-interval", "1",
        "--scrape-interval", "0.5",
        "--liveness", f"http://127.0.0.1:{port}/healthz",
        "--leader-elect",
        "--leader-elect-namespace", LEASE_NS,
        "--leader-elect-identity", identity,
        "--leader-elect-lease-duration", str(DURATION),
        "--leader-elect-renew-deadline", str(DEADLINE),
        "--leader-elect-retry-period", str(RETRY),
    ]  # fmt: skip


def holder(api) -> str | None:
    lease = api.get(LEASE)
    return (lease or {}).get("spec", {}).get("holderIdentity")


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def isvc_writes(writes: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Writes other than the Lease's and Events."""
    return [w for w in writes if w[1] != LEASE and not w[1].endswith("/events")]


@pytest.mark.timeout(120)
def test_standby_takes_over_within_the_lease_time_without_double_writes(api, start_operator):
    port_a, port_b = free_port(), free_port()
    leader = start_operator([NS], elected("a", port_a))
    wait_for(lambda: holder(api) == "a", what="a to take the Lease")
    wait_for(lambda: "Initial authentication has finished" in leader.log, what="a to start kopf")
    api.create(f"/apis/serving.kvpilot.io/v1alpha1/namespaces/{NS}/inferenceservices", new_isvc("first"))
    wait_for(lambda: api.get(child_path("Deployment", "first")), what="a to reconcile 'first'")
    lease = api.get(LEASE)
    assert lease["spec"]["leaseTransitions"] == 0 and lease["spec"]["leaseDurationSeconds"] == math.ceil(
        DURATION
    )

    standby = start_operator([NS], elected("b", port_b))
    wait_for(lambda: "standing by for Lease" in standby.log, what="b to stand by")
    wait_for(lambda: healthy(port_b), what="the standby's liveness endpoint")
    before = len(api.writes)
    reads = api.reads(LEASE)
    wait_for(lambda: api.reads(LEASE) >= reads + 12, what="a dozen Lease reads by both")
    assert holder(api) == "a"
    # While a leads, everything written is the Lease's renewal: b writes nothing, and a's resync
    # passes over unchanged objects write nothing either.
    assert isvc_writes(api.writes[before:]) == []
    assert "Initial authentication has finished" not in standby.log  # b never started kopf

    leader.proc.kill()  # no clean shutdown: the Lease is not released
    leader.proc.wait()
    killed_at_writes = len(api.writes)
    killed_at_reads = api.reads(LEASE)
    wait_for(lambda: holder(api) == "b", timeout=30, what="b to take the Lease over")
    # Only b reads the Lease now, once per retry period: it took over after at most the lease
    # duration's worth of attempts (plus the one that saw a's last renewal and the winning one).
    attempts = api.reads(LEASE) - killed_at_reads
    assert attempts <= math.ceil(DURATION / RETRY) + 2, attempts
    assert api.get(LEASE)["spec"]["leaseTransitions"] == 1
    wait_for(lambda: "Initial authentication has finished" in standby.log, what="b to start kopf")
    deployment_reads = api.reads(child_path("Deployment", "first"))
    wait_for(
        lambda: api.reads(child_path("Deployment", "first")) >= deployment_reads + 3,
        what="b's passes over 'first'",
    )
    assert isvc_writes(api.writes[killed_at_writes:]) == [], "b rewrote what a had written"

    api.create(f"/apis/serving.kvpilot.io/v1alpha1/namespaces/{NS}/inferenceservices", new_isvc("second"))
    wait_for(lambda: api.get(child_path("Deployment", "second")), what="b to reconcile 'second'")

    # A clean stop releases the Lease at once.
    assert standby.stop() == 0
    assert holder(api) == ""


def test_chart_grants_exactly_the_lease_verbs_the_operators_used(api):
    """Runs after the failover above (same API server): every Lease request is granted, and
    every Lease verb granted was used."""
    (role,) = by_kind(render("--set", "operator.replicaCount=2"))["Role"]
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    used = {v for v in api.verbs if v[0] == "coordination.k8s.io"}
    assert used == granted == {("coordination.k8s.io", "leases", v) for v in ("get", "create", "patch")}
