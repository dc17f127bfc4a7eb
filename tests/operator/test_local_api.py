"""The local platform's pure parts: the in-memory API under the operator's own reconcile, the rendered
container made local, and the front door's choice of replica. No processes here."""

from __future__ import annotations

import asyncio
import copy

import pytest

from kvpilot.operator.api import names
from kvpilot.operator.api.rest import ApiError, object_path
from kvpilot.operator.api.settings import resolve
from kvpilot.operator.local.api import LocalApi, matches
from kvpilot.operator.local.frontdoor import FrontDoor
from kvpilot.operator.local.platform import local_model_problem, prepare, status_line
from kvpilot.operator.local.process import assign_gpus, gpus_requested, local_args, local_env
from kvpilot.operator.reconcile.reconciler import reconcile
from kvpilot.operator.render.builders import build_children
from kvpilot.operator.router.scoring import Flight

ISVC_PATH = object_path(names.API_VERSION, names.KIND, "llm", "llama")
DEPLOYMENT_PATH = object_path("apps/v1", "Deployment", "llm", "llama")


def run(coro):
    return asyncio.run(coro)


def stored(make_isvc, api: LocalApi, **spec) -> dict:
    isvc = prepare(make_isvc(**spec))
    return run(api.create(isvc))


async def _noop(*_):
    return None


def test_reconcile_renders_exactly_what_the_builders_build(make_isvc):
    api = LocalApi()
    isvc = stored(make_isvc, api)
    assert isvc["metadata"]["generation"] == 1 and isvc["metadata"]["uid"]
    outcome = run(reconcile(api, resolve(isvc), _noop))
    assert outcome.problems == [] and outcome.conflicts == []
    assert sorted(outcome.written) == [
        "Created ConfigMap llama-live-config",
        "Created Deployment llama",
        "Created PodDisruptionBudget llama",
        "Created Service llama",
    ]
    expected = {c["kind"]: c for c in build_children(resolve(isvc))}
    deployment = api.read(DEPLOYMENT_PATH)
    assert deployment["spec"] == expected["Deployment"]["spec"]
    assert deployment["metadata"]["ownerReferences"][0]["uid"] == isvc["metadata"]["uid"]
    status = api.read(ISVC_PATH)["status"]
    assert status["phase"] == "Pending" and status["effective"]["replicas"] == 2
    # A second pass over an unchanged object writes nothing (the operator's idempotence holds here too).
    again = run(reconcile(api, resolve(api.read(ISVC_PATH)), _noop))
    assert again.written == [] and not again.status_written


def test_status_writes_are_isolated_and_stale_ones_refused(make_isvc):
    api = LocalApi()
    isvc = stored(make_isvc, api)
    version = isvc["metadata"]["resourceVersion"]
    patch = {"metadata": {"resourceVersion": version}, "status": {"phase": "Ready", "spec": "ignored?"}}
    live = run(api.merge_patch(ISVC_PATH + "/status", patch))
    assert live["status"]["phase"] == "Ready" and live["spec"] == isvc["spec"]
    assert live["metadata"]["generation"] == 1  # status writes never bump the generation
    with pytest.raises(ApiError) as stale:
        run(api.merge_patch(ISVC_PATH + "/status", {"metadata": {"resourceVersion": version}, "status": {}}))
    assert stale.value.status == 409


def test_apply_keeps_status_and_bumps_the_generation_on_spec_changes_only(make_isvc):
    api = LocalApi()
    isvc = stored(make_isvc, api)
    run(reconcile(api, resolve(isvc), _noop))
    deployment = api.read(DEPLOYMENT_PATH)
    assert api.write_status(DEPLOYMENT_PATH, {"readyReplicas": 2})
    assert not api.write_status(DEPLOYMENT_PATH, {"readyReplicas": 2})  # unchanged: no write
    desired = copy.deepcopy(deployment)
    desired.pop("status", None)
    same = run(api.apply(desired))
    assert same["metadata"]["generation"] == deployment["metadata"]["generation"]
    assert same["status"] == {"readyReplicas": 2}
    desired["spec"]["replicas"] = 3
    changed = run(api.apply(desired))
    assert changed["metadata"]["generation"] == deployment["metadata"]["generation"] + 1
    assert changed["status"] == {"readyReplicas": 2}


def test_lists_honour_label_selectors_and_missing_objects_are_404(make_isvc):
    api = LocalApi()
    pods = object_path("v1", "Pod", "llm")
    for name, labels in (("a", {"app": "x", "tier": "engine"}), ("b", {"app": "x"}), ("c", {"app": "y"})):
        api.put(
            f"{pods}/{name}",
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels}},
        )
    listing = run(api.request("GET", pods, params={"labelSelector": "app=x"}))
    assert [p["metadata"]["name"] for p in listing["items"]] == ["a", "b"]
    assert [p["metadata"]["name"] for p in api.list("pods", "llm", "app=x,tier=engine")] == ["a"]
    assert matches({"a": "1"}, "a") and not matches({"a": "1"}, "a!=1") and matches({}, "")
    assert run(api.get(f"{pods}/zzz")) is None
    with pytest.raises(ApiError) as missing:
        run(api.request("DELETE", f"{pods}/zzz"))
    assert missing.value.status == 404


def _container(make_isvc, **spec) -> dict:
    isvc = make_isvc(**spec)
    deployment = build_children(resolve(isvc))[0]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_local_args_keep_the_rendered_flags_and_adapt_what_a_cpu_cannot_run(make_isvc):
    container = _container(
        make_isvc,
        engine={
            "device": "cuda",
            "attentionBackend": "triton",
            "maxNumSeqs": 64,
            "gpuMemoryUtilization": 0.8,
        },
        resources={"gpusPerReplica": 2, "cpu": "1500m"},
    )
    args, notes = local_args(container, 41234, model_dir="/models/x", gpu=False)
    rendered = container["args"]
    assert args[0] == "/models/x" and rendered[0] == "/mnt/models/llama-3.1-8b"
    assert args[args.index("--host") + 1] == "127.0.0.1" and args[args.index("--port") + 1] == "41234"
    assert args[args.index("--device") + 1] == "cpu"
    assert args[args.index("--attention-backend") + 1] == "torch"
    for flag in ("--max-num-seqs", "--gpu-memory-utilization", "--served-model-name"):
        assert args[args.index(flag) + 1] == rendered[rendered.index(flag) + 1]
    assert len(args) == len(rendered)
    assert any("nvidia.com/gpu: 2" in n for n in notes) and any("device cuda" in n for n in notes)
    on_gpu, gpu_notes = local_args(container, 41234, gpu=True)
    assert on_gpu[on_gpu.index("--device") + 1] == "cuda" and gpu_notes == []
    assert on_gpu[0] == rendered[0]
    env, env_notes = local_env(container)
    assert env["OMP_NUM_THREADS"] == "2"  # 1500m rounded up
    assert "TRITON_CACHE_DIR" not in env and "XDG_CACHE_HOME" not in env  # the pod's /tmp volume
    assert env_notes == []


def test_gpus_go_to_one_replica_each_while_there_are_enough(make_isvc):
    container = _container(make_isvc, resources={"gpusPerReplica": 2}, engine={"tensorParallelSize": 1})
    assert gpus_requested(container) == 2
    assert gpus_requested(_container(make_isvc, resources={"gpusPerReplica": 0})) == 0
    ids = ["0", "1", "2", "3"]
    first, own = assign_gpus(ids, [], 2)
    assert (first, own) == (["0", "1"], True)
    second, own = assign_gpus(ids, [first], 2)
    assert (second, own) == (["2", "3"], True)
    third, own = assign_gpus(ids, [first, second], 2)
    assert len(third) == 2 and not own  # shared: a cluster would leave this pod Pending
    assert assign_gpus([], [], 1) == ([], True)


def test_local_env_skips_secrets_and_cluster_paths(make_isvc):
    container = _container(
        make_isvc,
        model={"source": "hf://org/model", "tokenSecretRef": {"name": "hf"}},
        apiKeySecretRef={"name": "key"},
        env=[{"name": "OMP_NUM_THREADS", "value": "3"}, {"name": "FROM_CM", "valueFrom": {"configMapKeyRef":
             {"name": "cm", "key": "k"}}}],
    )  # fmt: skip
    env, notes = local_env(container)
    assert env == {"OMP_NUM_THREADS": "3"}
    assert any("apiKeySecretRef" in n for n in notes) and any("FROM_CM" in n for n in notes)


def test_model_sources_that_cannot_run_here_are_named(make_isvc, tmp_path):
    assert "pass --model" in local_model_problem(make_isvc(), None)  # pvc://
    assert local_model_problem(make_isvc(), str(tmp_path)) is None
    assert "not a directory" in local_model_problem(make_isvc(model={"source": "file:///nope/x"}), None)
    assert local_model_problem(make_isvc(model={"source": f"file://{tmp_path}"}), None) is None


def test_front_door_picks_the_least_loaded_replica_and_alternates_ties():
    urls = ["http://a", "http://b", "http://c"]
    door = FrontDoor(lambda: urls, dict, logger=None)

    def send(url: str, count: int) -> None:  # requests the door sent there, no answer begun yet
        for _ in range(count):
            door.flights.add(url, Flight(uncached_tokens=100))

    send("http://a", 2)
    send("http://c", 1)
    assert door.pick() == "http://b"
    send("http://b", 2)
    assert door.pick() == "http://c"
    send("http://c", 1)
    assert {door.pick() for _ in range(6)} == set(urls)  # ties take turns
    assert door.pick(exclude={"http://a", "http://b", "http://c"}) is None


def test_status_line_reads_the_operator_status():
    isvc = {
        "status": {
            "phase": "Ready",
            "effective": {"replicas": 2, "gpuMemoryUtilization": 0.9, "maxNumSeqs": 64},
            "signals": {"preemptionsPerSecond": 1.5, "kvCacheUsage": 0.97, "requestsWaiting": 3.0},
        }
    }
    replicas = [{"ready": True, "current": True}, {"ready": False, "current": True}]
    line = status_line(isvc, replicas)
    assert line.startswith("Ready: 1/2 replicas ready | 1.5 preemptions/s, KV cache 97%, 3 waiting")
    assert "gpuMemoryUtilization=0.9 maxNumSeqs=64" in line
