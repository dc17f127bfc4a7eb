"""The real operator process against a Kubernetes API served on 127.0.0.1 (kmock, see kmock_apiserver).

One API server and one operator (``--resync-interval 1``) serve the module; each test works on its
own InferenceService. The module's last test checks the chart's RBAC against every request the
operator made during the module.
"""

from __future__ import annotations

import copy
import json
import socket
import subprocess
import urllib.error
import urllib.request

import pytest
import yaml

from kvpilot.operator.api import names
from tests.operator.conftest import BASE_ISVC, CHART, find_tool, wait_for
from tests.operator.crd_schema import admit

NS = "team-a"
ISVCS = f"/apis/{names.API_VERSION}/namespaces/{NS}/inferenceservices"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def isvc_path(name: str) -> str:
    return f"{ISVCS}/{name}"


def child_path(kind: str, name: str) -> str:
    return {
        "Deployment": f"/apis/apps/v1/namespaces/{NS}/deployments/{name}",
        "Service": f"/api/v1/namespaces/{NS}/services/{name}",
        "PodDisruptionBudget": f"/apis/policy/v1/namespaces/{NS}/poddisruptionbudgets/{name}",
        "ConfigMap": f"/api/v1/namespaces/{NS}/configmaps/{name}-live-config",
    }[kind]


def new_isvc(name: str, **spec) -> dict:
    isvc = copy.deepcopy(BASE_ISVC)
    isvc["metadata"] = {"name": name, "namespace": NS}
    isvc["spec"].update(spec)
    return isvc


def condition(isvc: dict, type_: str) -> dict:
    return next((c for c in (isvc.get("status") or {}).get("conditions", []) if c["type"] == type_), {})


def args_of(deployment: dict) -> list[str]:
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def mark_rolled_out(api, name: str, ready: int) -> None:
    """Do what the Deployment controller would: report pods of the current template as ready."""
    deployment = api.get(child_path("Deployment", name))
    replicas = deployment["spec"]["replicas"]
    api.merge_patch(
        child_path("Deployment", name) + "/status",
        {
            "status": {
                "observedGeneration": deployment["metadata"]["generation"],
                "replicas": replicas,
                "updatedReplicas": replicas,
                "readyReplicas": ready,
                "availableReplicas": ready,
            }
        },
    )


def events_for(api, name: str) -> list[dict]:
    listing = api.get(f"/api/v1/namespaces/{NS}/events") or {"items": []}
    return [e for e in listing["items"] if e.get("involvedObject", {}).get("name") == name]


@pytest.fixture(scope="module")
def operator(api, start_operator):
    # Remediation runs too (no engine pods here: it must list them and write nothing).
    proc = start_operator([NS], ["--resync-interval", "1", "--scrape-interval", "0.5"])
    wait_for(lambda: "Initial authentication has finished" in proc.log, what="the operator to log in")
    return proc


@pytest.fixture(autouse=True)
def delete_afterwards(api):
    """Each test's InferenceServices go away after it (keeps every resync pass small)."""
    yield
    for item in (api.get(ISVCS) or {"items": []})["items"]:
        api.delete(isvc_path(item["metadata"]["name"]))


def wait_for_passes(api, name: str, count: int) -> None:
    """Wait until at least ``count`` reconcile passes over ``name`` begun after the call have finished.

    Every pass, valid spec or not, reads the live Deployment once, and passes over one object never
    overlap: the operator's (count + 2)-th read from now starts after ``count`` such passes ended.
    """
    path = child_path("Deployment", name)
    start = api.reads(path)
    wait_for(lambda: api.reads(path) >= start + count + 2, what=f"{count} reconcile passes over {name}")


def create_and_wait(api, isvc: dict) -> dict:
    api.create(ISVCS, isvc)
    name = isvc["metadata"]["name"]
    wait_for(lambda: api.get(child_path("PodDisruptionBudget", name)), what=f"the children of {name}")
    handled = f"{names.KOPF_PREFIX}/last-handled-configuration"

    def settled() -> dict | None:
        obj = api.get(isvc_path(name))
        has_status = (obj.get("status") or {}).get("observedGeneration")
        # kopf records the handled spec once its handler has finished: the creation is complete.
        return obj if has_status and handled in (obj["metadata"].get("annotations") or {}) else None

    return wait_for(settled, what=f"status of {name}")


def test_create_makes_owned_children_and_status(api, operator):
    isvc = create_and_wait(api, new_isvc("create"))
    uid = isvc["metadata"]["uid"]
    for kind in ("Deployment", "Service", "PodDisruptionBudget"):
        child = api.get(child_path(kind, "create"))
        assert child["metadata"]["ownerReferences"][0]["uid"] == uid, kind
        assert child["metadata"]["ownerReferences"][0]["controller"] is True
    deployment = api.get(child_path("Deployment", "create"))
    assert deployment["spec"]["replicas"] == 2
    assert args_of(deployment)[:1] == ["/mnt/models/llama-3.1-8b"]
    assert "--max-num-seqs" in args_of(deployment) and "128" in args_of(deployment)
    assert api.get(child_path("Service", "create"))["spec"]["ports"][0]["port"] == 8000
    status = isvc["status"]
    assert status["phase"] == "Pending" and status["observedGeneration"] == 1
    assert (
        status["selector"] == "app.kubernetes.io/component=engine,serving.kvpilot.io/inferenceservice=create"
    )
    assert status["effective"]["maxNumSeqs"] == 128 and status["effective"]["replicas"] == 2
    assert condition(isvc, "SpecValid")["status"] == "True"
    # Status goes through the status subresource; the spec is never written by the operator.
    assert ("PATCH", isvc_path("create") + "/status") in api.writes
    schema = api.crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert isvc["spec"] == admit(new_isvc("create"), schema)[0]["spec"]  # as created, CRD defaults filled
    assert not isvc["metadata"].get("finalizers"), "no finalizer: deletion never waits for the operator"
    normal = {e["reason"] for e in events_for(api, "create") if e["type"] == "Normal"}
    assert {"Created"} <= normal


def test_rollout_progress_reaches_ready(api, operator):
    create_and_wait(api, new_isvc("rollout"))
    mark_rolled_out(api, "rollout", ready=1)
    isvc = wait_for(
        lambda: (o := api.get(isvc_path("rollout")))["status"].get("readyReplicas") == 1 and o, what="1 ready"
    )
    assert isvc["status"]["phase"] == "Progressing" and condition(isvc, "Ready")["status"] == "False"
    mark_rolled_out(api, "rollout", ready=2)
    isvc = wait_for(
        lambda: (o := api.get(isvc_path("rollout")))["status"]["phase"] == "Ready" and o, what="Ready"
    )
    assert (isvc["status"]["replicas"], isvc["status"]["readyReplicas"]) == (2, 2)
    assert condition(isvc, "Ready")["status"] == "True"
    assert condition(isvc, "Progressing")["reason"] == "RolloutComplete"


def test_spec_update_changes_the_deployment(api, operator):
    create_and_wait(api, new_isvc("update"))
    before = api.get(child_path("Deployment", "update"))
    api.merge_patch(isvc_path("update"), {"spec": {"replicas": 3, "engine": {"maxNumSeqs": 64}}})
    deployment = wait_for(
        lambda: (d := api.get(child_path("Deployment", "update")))["spec"]["replicas"] == 3 and d,
        what="the new replica count",
    )
    args = args_of(deployment)
    assert args[args.index("--max-num-seqs") + 1] == "64"
    assert (
        deployment["spec"]["template"]["metadata"]["labels"][names.LABEL_TEMPLATE_HASH]
        != (before["spec"]["template"]["metadata"]["labels"][names.LABEL_TEMPLATE_HASH])
    )
    isvc = wait_for(lambda: (o := api.get(isvc_path("update")))["status"]["observedGeneration"] == 2 and o)
    assert isvc["status"]["effective"] == {
        "gpuMemoryUtilization": 0.9,
        "maxNumSeqs": 64,
        "tensorParallelSize": 1,
        "pipelineParallelSize": 1,
        "replicas": 3,
        "basedOnGeneration": 2,
    }
    # kopf's bookkeeping lives in annotations under the project's prefix (written once the handler
    # has finished, so possibly just after the status), not in spec or status.
    key = f"{names.KOPF_PREFIX}/last-handled-configuration"

    def last_handled() -> dict:
        return json.loads(api.get(isvc_path("update"))["metadata"]["annotations"][key])

    wait_for(lambda: last_handled()["spec"]["engine"]["maxNumSeqs"] == 64, what="kopf's annotation")
    assert "status" not in last_handled()


def test_a_settled_object_costs_no_writes(api, operator):
    create_and_wait(api, new_isvc("quiet"))
    mark_rolled_out(api, "quiet", ready=2)
    wait_for(lambda: api.get(isvc_path("quiet"))["status"]["phase"] == "Ready", what="Ready")
    wait_for_passes(api, "quiet", 1)  # whatever was in flight when Ready showed has finished
    before = len(api.writes)
    wait_for_passes(api, "quiet", 3)
    assert api.writes[before:] == []
    assert operator.proc.poll() is None


def test_drift_is_repaired(api, operator):
    create_and_wait(api, new_isvc("drift"))
    api.merge_patch(child_path("Deployment", "drift"), {"spec": {"replicas": 7}})
    wait_for(
        lambda: api.get(child_path("Deployment", "drift"))["spec"]["replicas"] == 2, what="replicas restored"
    )
    api.delete(child_path("Service", "drift"))
    service = wait_for(
        lambda: api.get(child_path("Service", "drift")), what="the Service recreated by the resync"
    )
    assert service["metadata"]["labels"][names.LABEL_ISVC] == "drift"


def test_hand_edits_of_the_engine_deployment_are_restored_with_one_write(api, operator):
    create_and_wait(api, new_isvc("edited"))
    path = child_path("Deployment", "edited")
    rendered = api.get(path)
    container = copy.deepcopy(rendered["spec"]["template"]["spec"]["containers"][0])
    wanted = (container["image"], list(container["args"]), copy.deepcopy(container.get("env")))
    container["image"] = "someone/else:latest"  # kubectl set image
    container["args"] = [*container["args"], "--max-num-seqs", "999"]  # kubectl edit
    before = len(api.writes)
    api.merge_patch(path, {"spec": {"template": {"spec": {"containers": [container]}}}})

    def restored() -> dict | None:
        live = api.get(path)["spec"]["template"]["spec"]["containers"][0]
        return live if (live["image"], live["args"], live.get("env")) == wanted else None

    # (An env var or sidecar another manager adds survives the operator's apply on a real API server,
    # as tests/k8s/test_control_plane.py shows; the fake refuses such an apply rather than model it.)
    wait_for(restored, what="the image and args restored")
    # A second drift, repaired by a later pass: proof that the passes after the first repair found
    # nothing more to write there (a write loop would show as extra writes).
    api.merge_patch(path, {"spec": {"replicas": 7}})
    wait_for(lambda: api.get(path)["spec"]["replicas"] == 2, what="replicas restored")
    writes = [w for w in api.writes[before:] if w[1] == path]
    assert len(writes) == 4, writes  # each edit, then one apply by the operator
    template = api.get(path)["spec"]["template"]
    assert template["metadata"]["labels"] == rendered["spec"]["template"]["metadata"]["labels"]


def test_other_managers_fields_survive_a_reconcile_and_dropped_fields_go(api, operator):
    """Server-side apply: the operator owns what it renders, nothing else."""
    create_and_wait(api, new_isvc("managed", pod={"annotations": {"example.com/team": "search"}}))
    path = child_path("Deployment", "managed")
    assert api.get(path)["spec"]["template"]["metadata"]["annotations"]["example.com/team"] == "search"
    api.request(  # kubectl annotate deployment managed example.com/on-call=alice
        "PATCH",
        path + "?fieldManager=kubectl-annotate",
        {"metadata": {"annotations": {"example.com/on-call": "alice"}}},
        "application/merge-patch+json",
    )
    # The user drops the pod annotation and changes an engine value: the operator re-applies.
    api.merge_patch(isvc_path("managed"), {"spec": {"pod": None, "engine": {"maxNumSeqs": 64}}})
    live = wait_for(lambda: "64" in args_of(d := api.get(path)) and d, what="the re-rendered Deployment")
    assert "example.com/team" not in live["spec"]["template"]["metadata"]["annotations"]
    assert live["metadata"]["annotations"]["example.com/on-call"] == "alice"
    managers = {(e["manager"], e["operation"]): e["fieldsV1"] for e in live["metadata"]["managedFields"]}
    assert managers[("kubectl-annotate", "Update")] == {
        "f:metadata": {"f:annotations": {"f:example.com/on-call": {}}}
    }
    assert "f:spec" in managers[(names.FIELD_MANAGER, "Apply")]


def test_a_410_gone_watch_relists_and_resumes_without_double_action(api, operator):
    create_and_wait(api, new_isvc("relist"))
    mark_rolled_out(api, "relist", ready=2)
    wait_for(lambda: api.get(isvc_path("relist"))["status"]["phase"] == "Ready", what="Ready")
    wait_for_passes(api, "relist", 1)
    path = child_path("Deployment", "relist")
    restarts = operator.log.count("Restarting the watch-stream for inferenceservices")
    before = len(api.writes)
    first_served = api.expire_watches()
    wait_for(
        lambda: operator.log.count("Restarting the watch-stream for inferenceservices") > restarts,
        what="kopf to take the 410 Gone",
    )
    wait_for(
        lambda: any(v and int(v) > first_served for v in api.watches(ISVCS)),
        what="a watch resumed from a fresh list",
    )
    wait_for_passes(api, "relist", 2)
    assert [w for w in api.writes[before:] if w[1] == path] == [], "a re-list alone changes nothing"
    # The next change is handled once: one apply of the Deployment.
    api.merge_patch(isvc_path("relist"), {"spec": {"engine": {"maxNumSeqs": 64}}})
    wait_for(lambda: "64" in args_of(api.get(path)), what="the change applied")
    wait_for_passes(api, "relist", 2)
    assert [w for w in api.writes[before:] if w[1] == path] == [("PATCH", path)]


def test_a_spec_the_crd_rejects_never_reaches_the_operator(api, operator):
    """blockSize 24 is outside the CRD's enum: the API server answers 422 naming the field."""
    create_and_wait(api, new_isvc("rejected"))
    before = api.get(isvc_path("rejected"))
    with pytest.raises(urllib.error.HTTPError) as info:
        api.merge_patch(isvc_path("rejected"), {"spec": {"engine": {"blockSize": 24}}})
    assert info.value.code == 422
    body = json.loads(info.value.read())
    assert [c["field"] for c in body["details"]["causes"]] == ["spec.engine.blockSize"]
    after = api.get(isvc_path("rejected"))
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]
    assert after["spec"] == before["spec"]


def test_invalid_spec_sets_condition_and_warns_without_touching_pods(api, operator):
    # Passes the CRD's schema and CEL rules (a user can apply it) but not the operator's own checks:
    # 8Gi of pod memory cannot hold 16 GiB of swapped KV blocks.
    create_and_wait(api, new_isvc("invalid", resources={"memory": "8Gi"}))
    good = api.get(child_path("Deployment", "invalid"))
    api.merge_patch(isvc_path("invalid"), {"spec": {"engine": {"preemptionMode": "swap", "swapSpace": 16}}})
    isvc = wait_for(
        lambda: (
            (o := api.get(isvc_path("invalid"))) and condition(o, "SpecValid").get("status") == "False" and o
        ),
        what="SpecValid=False",
    )
    message = condition(isvc, "SpecValid")["message"]
    assert "spec.resources.memory 8Gi cannot hold swapSpace 16 GiB" in message
    assert isvc["status"]["phase"] == "Failed" and isvc["status"]["observedGeneration"] == 2
    warnings = wait_for(
        lambda: [
            e for e in events_for(api, "invalid") if e["type"] == "Warning" and e["reason"] == "InvalidSpec"
        ],
        what="a Warning event",
    )
    assert "swapSpace" in warnings[0]["message"]
    wait_for_passes(api, "invalid", 2)  # resync passes: no second event, pods keep the last valid config
    assert len([e for e in events_for(api, "invalid") if e["reason"] == "InvalidSpec"]) == 1
    assert api.get(child_path("Deployment", "invalid"))["spec"] == good["spec"]
    assert operator.proc.poll() is None, "an invalid spec must not crash the operator"
    api.merge_patch(isvc_path("invalid"), {"spec": {"engine": {"swapSpace": 4}}})
    wait_for(
        lambda: condition(api.get(isvc_path("invalid")), "SpecValid").get("status") == "True",
        what="valid again",
    )
    assert "--swap-space" in args_of(api.get(child_path("Deployment", "invalid")))


def test_foreign_object_with_the_same_name_is_left_alone(api, operator):
    foreign = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "taken", "namespace": NS, "labels": {"owner": "someone-else"}},
        "spec": {"ports": [{"port": 80}]},
    }
    api.create(f"/api/v1/namespaces/{NS}/services", foreign)
    api.create(ISVCS, new_isvc("taken"))
    isvc = wait_for(
        lambda: (
            (o := api.get(isvc_path("taken")))
            and condition(o, "Ready").get("reason") == "ChildConflict"
            and o
        ),
        what="ChildConflict",
    )
    assert "Service taken exists and is not owned" in condition(isvc, "Ready")["message"]
    assert api.get(child_path("Service", "taken"))["metadata"]["labels"] == {"owner": "someone-else"}
    assert api.get(child_path("Deployment", "taken")) is not None  # the other children are still made


def live_config_of(api, name: str) -> dict:
    return json.loads(api.get(child_path("ConfigMap", name))["data"]["live-config.json"])


def test_remediation_overrides_in_status_reach_the_pods(api, operator):
    isvc = create_and_wait(api, new_isvc("override"))
    template = api.get(child_path("Deployment", "override"))["spec"]["template"]
    assert live_config_of(api, "override") == {}
    # A live lever (maxNumSeqs below its start-up value): the ConfigMap the pods read at start
    # carries it; the pod template does not, so nothing rolls out.
    api.merge_patch(
        isvc_path("override") + "/status",
        {
            "status": {
                "effective": {"overrides": {"maxNumSeqs": {"value": 32, "specValue": 128, "reason": "storm"}}}
            }
        },
    )
    wait_for(lambda: live_config_of(api, "override") == {"max_num_seqs": 32}, what="the live override")
    isvc = wait_for(
        lambda: (o := api.get(isvc_path("override")))["status"]["effective"]["maxNumSeqs"] == 32 and o
    )
    assert api.get(child_path("Deployment", "override"))["spec"]["template"] == template
    args = args_of(api.get(child_path("Deployment", "override")))
    assert args[args.index("--max-num-seqs") + 1] == "128"  # the start-up value: the live bound's ceiling
    # A restart lever reaches the pod template.
    api.merge_patch(
        isvc_path("override") + "/status",
        {
            "status": {
                "effective": {
                    "overrides": {
                        "gpuMemoryUtilization": {"value": 0.95, "specValue": 0.9, "reason": "storm"}
                    }
                }
            }
        },
    )
    deployment = wait_for(
        lambda: "0.95" in args_of(d := api.get(child_path("Deployment", "override"))) and d,
        what="the override",
    )
    assert deployment["spec"]["template"] != template
    assert isvc["spec"]["engine"]["maxNumSeqs"] == 128, "the operator never writes spec"
    # The user edits the lever: the override no longer applies, the spec wins.
    api.merge_patch(isvc_path("override"), {"spec": {"engine": {"maxNumSeqs": 100}}})
    wait_for(lambda: "100" in args_of(api.get(child_path("Deployment", "override"))), what="the user's value")
    wait_for(lambda: live_config_of(api, "override") == {}, what="the live override to go")


def test_deletion_leaves_nothing_behind(api, operator):
    create_and_wait(api, new_isvc("witness"))  # its passes prove resyncs ran after the deletion
    create_and_wait(api, new_isvc("gone"))
    api.delete(isvc_path("gone"))
    wait_for(lambda: api.get(isvc_path("gone")) is None, what="the InferenceService to go")
    for kind in ("Deployment", "Service", "PodDisruptionBudget"):
        wait_for(lambda k=kind: api.get(child_path(k, "gone")) is None, what=f"the {kind} to be collected")
    wait_for_passes(api, "witness", 2)  # resync passes over the namespace must not resurrect anything
    assert api.get(child_path("Deployment", "gone")) is None
    assert api.get(child_path("Service", "gone")) is None


def test_restarted_operator_resumes_without_writing(api, operator, start_operator):
    create_and_wait(api, new_isvc("resume"))
    mark_rolled_out(api, "resume", ready=2)
    wait_for(lambda: api.get(isvc_path("resume"))["status"]["phase"] == "Ready", what="Ready")
    wait_for_passes(api, "resume", 1)  # whatever was in flight when Ready showed has finished
    assert operator.stop() == 0, "SIGTERM stops the operator cleanly"
    before = len(api.writes)
    port = free_port()
    liveness = f"http://127.0.0.1:{port}/healthz"
    restarted = start_operator([], ["--all-namespaces", "--resync-interval", "1", "--liveness", liveness])
    wait_for(lambda: "Resuming is processed" in restarted.log, what="the resume pass")
    wait_for_passes(api, "resume", 2)  # and resync passes after it
    writes = [w for w in api.writes[before:] if not w[1].endswith("/events")]
    assert writes == [], "a resume over unchanged objects writes nothing"
    with urllib.request.urlopen(liveness, timeout=5) as response:  # what the chart's livenessProbe calls
        assert response.status == 200


def test_kubectl_printer_columns_and_short_name(api, operator, tmp_path):
    kubectl = find_tool("kubectl")
    create_and_wait(api, new_isvc("columns"))
    mark_rolled_out(api, "columns", ready=2)
    wait_for(lambda: api.get(isvc_path("columns"))["status"]["phase"] == "Ready", what="Ready")
    crd = yaml.safe_load((CHART / "files" / "crds" / "inferenceservice.yaml").read_text())
    columns = [c for c in crd["spec"]["versions"][0]["additionalPrinterColumns"] if c["name"] != "Age"]
    spec = ",".join(f"{c['name'].upper()}:{{{c['jsonPath']}}}" for c in columns)
    kubeconfig = api.kubeconfig(tmp_path / "kubeconfig")
    result = subprocess.run(
        [
            kubectl,
            "--kubeconfig",
            str(kubeconfig),
            "--cache-dir",
            str(tmp_path / "cache"),
            "get",
            names.SHORT_NAME,
            "columns",
            "-n",
            NS,
            "-o",
            f"custom-columns=NAME:.metadata.name,{spec}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    header, row = result.stdout.splitlines()
    assert header.split() == [
        "NAME",
        "PHASE",
        "RUNTIME",
        "READY",
        "REPLICAS",
        "MEMFRAC",
        "MAXSEQS",
        "PREEMPT/S",
        "KVUSAGE",
        "MODEL",
    ]
    # Signals are remediation's (not written yet): kubectl shows <none> there.
    assert row.split() == [
        "columns",
        "Ready",
        "kvpilot",  # defaulted by the CRD schema on create
        "2",
        "2",
        "0.9",
        "128",
        "<none>",
        "<none>",
        "pvc://models/llama-3.1-8b",
    ]


def test_router_and_autoscaling_children_come_change_and_go(api, operator):
    """spec.router and spec.autoscaling through the operator process, with the published CRDs
    registered (tests/k8s/crds): every child is created, patched on a spec change and deleted when
    its field goes (what the RBAC check below needs observed)."""
    from pathlib import Path

    from tests.operator.kmock_apiserver import register_crd

    for crd_file in sorted((Path(__file__).resolve().parents[1] / "k8s" / "crds").glob("*.yaml")):
        register_crd(api.server, yaml.safe_load(crd_file.read_text()))
    group_paths = {
        "InferencePool": f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools/routed",
        "HTTPRoute": f"/apis/gateway.networking.k8s.io/v1/namespaces/{NS}/httproutes/routed",
        "ScaledObject": f"/apis/keda.sh/v1alpha1/namespaces/{NS}/scaledobjects/routed",
        "HorizontalPodAutoscaler": f"/apis/autoscaling/v2/namespaces/{NS}/horizontalpodautoscalers/routed",
    }
    keda = {"maxReplicaCount": 4, "prometheus": {"serverAddress": "http://prometheus:9090"}}
    router = {"inferencePool": {"endpointPicker": {}, "httpRoute": {"gatewayName": "gw"}}, "frontDoor": {}}
    create_and_wait(api, new_isvc("routed", router=router, autoscaling={"keda": keda}))
    for kind in ("InferencePool", "HTTPRoute", "ScaledObject"):
        wait_for(lambda kind=kind: api.get(group_paths[kind]), what=kind)
    for name in ("routed-epp", "routed-router"):
        wait_for(lambda name=name: api.get(child_path("Deployment", name)), what=name)
    assert "replicas" not in api.get(child_path("Deployment", "routed"))["spec"]

    router_change = {"inferencePool": {"failureMode": "FailOpen", "httpRoute": {"pathPrefix": "/v1"}}}
    keda_change = {"keda": {"maxReplicaCount": 5}}
    api.merge_patch(isvc_path("routed"), {"spec": {"router": router_change, "autoscaling": keda_change}})
    wait_for(lambda: api.get(group_paths["ScaledObject"])["spec"]["maxReplicaCount"] == 5, what="patched")
    ref = lambda: api.get(group_paths["InferencePool"])["spec"]["endpointPickerRef"]  # noqa: E731
    wait_for(lambda: ref()["failureMode"] == "FailOpen", what="InferencePool patched")

    api.merge_patch(isvc_path("routed"), {"spec": {"autoscaling": {"keda": None, "hpa": {"maxReplicas": 3}}}})
    wait_for(lambda: api.get(group_paths["HorizontalPodAutoscaler"]), what="HPA")
    wait_for(lambda: api.get(group_paths["ScaledObject"]) is None, what="ScaledObject deleted")
    api.merge_patch(isvc_path("routed"), {"spec": {"autoscaling": {"hpa": {"maxReplicas": 6}}}})
    wait_for(lambda: api.get(group_paths["HorizontalPodAutoscaler"])["spec"]["maxReplicas"] == 6, what="HPA")

    # Scale to zero under the front door, replicas the operator's: the router's grant to wake the
    # service comes, and goes when zero is no longer allowed.
    api.merge_patch(isvc_path("routed"), {"spec": {"autoscaling": None}})
    wait_for(lambda: api.get(group_paths["HorizontalPodAutoscaler"]) is None, what="HPA deleted")
    grant_paths = [
        f"/api/v1/namespaces/{NS}/serviceaccounts/routed-router",
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/roles/routed-router",
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{NS}/rolebindings/routed-router",
    ]
    limits = lambda n: {"spec": {"remediation": {"limits": {"minReplicas": n}}}}  # noqa: E731
    api.merge_patch(isvc_path("routed"), limits(0))
    for path in grant_paths:
        wait_for(lambda path=path: api.get(path), what=f"{path} created")
    role = api.get(grant_paths[1])
    assert role["rules"][0]["resourceNames"] == ["routed"] and role["rules"][0]["verbs"] == ["get", "patch"]
    router_pod = api.get(child_path("Deployment", "routed-router"))["spec"]["template"]["spec"]
    assert router_pod["serviceAccountName"] == "routed-router"
    api.merge_patch(isvc_path("routed"), limits(1))
    for path in grant_paths:
        wait_for(lambda path=path: api.get(path) is None, what=f"{path} deleted")

    api.merge_patch(isvc_path("routed"), {"spec": {"router": None}})
    for path in [*group_paths.values(), child_path("Deployment", "routed-epp")]:
        wait_for(lambda path=path: api.get(path) is None, what=f"{path} deleted")
    engine = child_path("Deployment", "routed")
    wait_for(lambda: api.get(engine)["spec"].get("replicas") == 2, what="the operator's replicas back")


def granted_verbs() -> set[tuple[str, str, str]]:
    """(group, resource, verb) the chart's namespaced Role grants."""
    helm = find_tool("helm")
    rendered = subprocess.run(
        [helm, "template", "t", str(CHART), "--set", f"operator.watchNamespaces={{{NS}}}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    (role,) = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "Role"]
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_chart_rbac_grants_exactly_what_the_operator_used(api):
    """Runs last in the module: ``api.verbs`` holds every request the operators made above."""
    granted = granted_verbs()
    used = api.verbs
    assert used - granted == set(), "the operator used verbs the chart does not grant"
    # Only admission-time needs go unobserved here: blockOwnerDeletion checks update on finalizers; and
    # the API key read of a live change (test_remediation_live_kmock uses and checks it).
    unobserved = {(names.GROUP, f"{names.PLURAL}/finalizers", "update"), ("", "secrets", "get")}
    assert granted - used == unobserved, json.dumps(sorted(granted - used))
