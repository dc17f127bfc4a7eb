"""Leader election on a real Lease and watches cut by an API server restart, on the real control plane.

Who wrote what is read from the API server's audit log: the two replicas authenticate as different
users, so "no object is written by both" is a set intersection, not an operator's account of itself.
"""

from __future__ import annotations

import json
import math
import time

import pytest

from tests.k8s.cluster import OPERATOR_TOKEN, OPERATOR_USER, STANDBY_TOKEN, STANDBY_USER, Cluster
from tests.k8s.test_control_plane import NS, isvc
from tests.operator.conftest import OperatorProcess, wait_for
from tests.operator.test_leader_failover import DURATION, LEASE, LEASE_NS, RETRY, elected
from tests.operator.test_operator_kmock import free_port

WRITES = {"create", "update", "patch", "delete"}


@pytest.fixture(scope="module")
def ready_cluster(cluster: Cluster) -> Cluster:
    return cluster.install_crd(NS, LEASE_NS)


def holder(cluster: Cluster) -> str | None:
    lease = cluster.request("GET", LEASE)
    return (lease.get("spec") or {}).get("holderIdentity")


def object_writes(cluster: Cluster, user: str) -> list[dict]:
    """``user``'s writes of objects, oldest first: Leases (the election's own record) and Events (the
    operator's notes) left out."""
    return [
        e
        for e in cluster.audit(user)
        if e["verb"] in WRITES
        and (e.get("objectRef") or {}).get("resource") not in (None, "leases", "events")
    ]


def written(cluster: Cluster, user: str) -> set[tuple[str, str]]:
    """(resource, name) of every object ``user`` wrote."""
    return {
        (e["objectRef"].get("resource"), e["objectRef"].get("name")) for e in object_writes(cluster, user)
    }


def settled(cluster: Cluster, user: str, quiet_s: float = 4.0) -> None:
    """Wait until ``user`` has written nothing for ``quiet_s`` (four resync passes): the Deployment's
    status, which the controller manager fills in, has reached the InferenceService's status."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        count = len(object_writes(cluster, user))
        time.sleep(quiet_s)
        if len(object_writes(cluster, user)) == count:
            return
    raise AssertionError(f"{user} kept writing for 60 s")


def exists(cluster: Cluster, what: str) -> bool:
    return cluster.kubectl("get", "-n", NS, what, check=False).returncode == 0


@pytest.mark.timeout(180)
def test_standby_takes_over_a_real_lease_and_nothing_is_written_by_both(
    ready_cluster: Cluster, tmp_path_factory
):
    cluster = ready_cluster
    tmp = tmp_path_factory.mktemp("leader")
    a = OperatorProcess(cluster.identity(OPERATOR_TOKEN), tmp, [NS], elected("a", free_port()))
    b = None
    try:
        wait_for(lambda: holder(cluster) == "a", 60, "a to take the Lease")
        cluster.kubectl("apply", "-f", "-", input=json.dumps(isvc("first")))
        wait_for(lambda: exists(cluster, "deployment/first"), 60, "a to reconcile 'first'")
        settled(cluster, OPERATOR_USER)
        b = OperatorProcess(cluster.identity(STANDBY_TOKEN), tmp, [NS], elected("b", free_port()))
        wait_for(lambda: "standing by for Lease" in b.log, 60, "b to stand by")
        lease_reads = len([e for e in cluster.audit(STANDBY_USER, resource="leases") if e["verb"] == "get"])
        wait_for(
            lambda: (
                len([e for e in cluster.audit(STANDBY_USER, resource="leases") if e["verb"] == "get"])
                >= lease_reads + 8
            ),
            30,
            "b's attempts on the Lease",
        )
        assert holder(cluster) == "a"
        assert written(cluster, STANDBY_USER) == set(), "the standby wrote while a led"

        a.proc.kill()  # no clean shutdown: the Lease is not released
        a.proc.wait()
        seen = len(cluster.audit(STANDBY_USER, resource="leases"))
        wait_for(lambda: holder(cluster) == "b", 30, "b to take the Lease over")
        attempts = cluster.audit(STANDBY_USER, resource="leases")[seen:]
        reads = [e for e in attempts if e["verb"] == "get"]
        # b took over after at most the lease duration's worth of attempts (plus the one that saw a's
        # last renewal and the winning one), counted by the API server.
        assert len(reads) <= math.ceil(DURATION / RETRY) + 2, len(reads)
        wait_for(lambda: "Initial authentication has finished" in b.log, 60, "b to start kopf")
        cluster.kubectl("apply", "-f", "-", input=json.dumps(isvc("second")))
        wait_for(lambda: exists(cluster, "deployment/second"), 60, "b to reconcile 'second'")
        both = written(cluster, OPERATOR_USER) & written(cluster, STANDBY_USER)
        detail = [
            (e["user"]["username"], e["verb"], e["objectRef"].get("subresource"), e.get("requestObject"))
            for e in cluster.audit()
            if e["verb"] in WRITES
            and (e.get("objectRef", {}).get("resource"), e.get("objectRef", {}).get("name")) in both
        ]
        assert both == set(), f"written by both replicas: {detail}"
        assert ("deployments", "second") in written(cluster, STANDBY_USER)
        assert b.stop() == 0
        assert holder(cluster) == "", "a clean stop releases the Lease"
    finally:
        a.stop()
        if b is not None:
            b.stop()


@pytest.mark.timeout(180)
def test_watches_cut_by_an_api_server_restart_resume_and_miss_no_change(
    ready_cluster: Cluster, tmp_path_factory
):
    cluster = ready_cluster
    proc = OperatorProcess(
        cluster.identity(OPERATOR_TOKEN), tmp_path_factory.mktemp("watch"), [NS], ["--resync-interval", "300"]
    )
    try:
        cluster.kubectl("apply", "-f", "-", input=json.dumps(isvc("watched")))
        wait_for(lambda: exists(cluster, "deployment/watched"), 60, "the Deployment")
        cluster.restart_apiserver()  # every watch is cut; the watch cache starts again from etcd
        # A change made right after the restart, while the operator's watches reconnect: with a
        # five-minute resync, only a resumed watch can deliver it in time.
        cluster.kubectl(
            "patch",
            "-n",
            NS,
            "inferenceservice/watched",
            "--type=merge",
            "-p",
            '{"spec":{"engine":{"maxNumSeqs":4}}}',
        )

        def args() -> list[str]:
            live = json.loads(cluster.kubectl("get", "-n", NS, "deployment/watched", "-o", "json").stdout)
            return live["spec"]["template"]["spec"]["containers"][0]["args"]

        wait_for(
            lambda: "4" == (a := args())[a.index("--max-num-seqs") + 1], 90, "the change after the restart"
        )
        assert proc.proc.poll() is None
    finally:
        proc.stop()
        print(f"\n--- operator log tail ---\n{proc.log[-3000:]}")
