"""The Kubernetes API fake against the semantics the operator tests rely on: a write of an
InferenceService goes through the CRD's schema, defaulting, pruning and CEL rules, as on a real
API server (422 naming the field path; nothing stored)."""

from __future__ import annotations

import copy
import json
import urllib.error
import urllib.request

import pytest

from kvpilot.operator.api import names
from tests.operator import kmock_fields
from tests.operator.conftest import BASE_ISVC

NS = "fake"
ISVCS = f"/apis/{names.API_VERSION}/namespaces/{NS}/inferenceservices"


def new_isvc(name: str, **spec) -> dict:
    isvc = copy.deepcopy(BASE_ISVC)
    isvc["metadata"] = {"name": name, "namespace": NS}
    isvc["spec"].update(copy.deepcopy(spec))
    return isvc


def rejection(call) -> dict:
    """The Status body of a request that must fail with 422."""
    with pytest.raises(urllib.error.HTTPError) as info:
        call()
    assert info.value.code == 422
    return json.loads(info.value.read())


def fields(status: dict) -> list[str]:
    return [cause["field"] for cause in status["details"]["causes"]]


def test_create_outside_the_enum_is_rejected_with_the_field_path(api):
    status = rejection(lambda: api.create(ISVCS, new_isvc("enum", engine={"blockSize": 24})))
    assert status["reason"] == "Invalid"
    assert fields(status) == ["spec.engine.blockSize"]
    assert "24 is not one of" in status["message"]
    assert api.get(f"{ISVCS}/enum") is None


def test_patch_failing_the_schema_changes_nothing(api):
    path = f"{ISVCS}/patched"
    created = api.create(ISVCS, new_isvc("patched"))
    status = rejection(lambda: api.merge_patch(path, {"spec": {"engine": {"blockSize": 24}}}))
    assert fields(status) == ["spec.engine.blockSize"]
    status = rejection(lambda: api.merge_patch(path, {"spec": {"replicas": "two"}}))
    assert fields(status) == ["spec.replicas"]
    live = api.get(path)
    assert live["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]
    assert live["spec"] == created["spec"]
    api.delete(path)


def test_cel_rules_run_on_writes(api):
    engine = {"enableChunkedPrefill": False, "maxNumBatchedTokens": 2048, "maxModelLen": 8192}
    status = rejection(lambda: api.create(ISVCS, new_isvc("cel", engine=engine)))
    assert fields(status) == ["spec.engine"]
    assert (
        "maxNumBatchedTokens must be >= maxModelLen when enableChunkedPrefill is false" in status["message"]
    )
    long_name = new_isvc("x" * 64)
    status = rejection(lambda: api.create(ISVCS, long_name))
    assert "metadata.name must be at most 63 characters" in status["message"]


def test_status_writes_are_validated_too(api):
    path = f"{ISVCS}/status-checked"
    api.create(ISVCS, new_isvc("status-checked"))
    status = rejection(lambda: api.merge_patch(path + "/status", {"status": {"replicas": "many"}}))
    assert fields(status) == ["status.replicas"]
    api.delete(path)


def test_defaults_are_stored_and_unknown_fields_pruned(api):
    isvc = new_isvc("defaulted", resources={"memory": "64Gi"})
    isvc["spec"]["notAField"] = 1
    del isvc["spec"]["replicas"]
    stored = api.create(ISVCS, isvc)
    assert "notAField" not in stored["spec"]
    assert stored["spec"]["replicas"] == 1
    assert stored["spec"]["resources"] == {
        "memory": "64Gi",
        "gpusPerReplica": 1,
        "gpuResource": "nvidia.com/gpu",
    }
    assert api.get(f"{ISVCS}/defaulted")["spec"] == stored["spec"]
    api.delete(f"{ISVCS}/defaulted")


def test_strict_field_validation_rejects_unknown_fields(api):
    isvc = new_isvc("strict")
    isvc["spec"]["notAField"] = 1
    status = rejection(lambda: api.create(ISVCS + "?fieldValidation=Strict", isvc))
    assert "notAField" in status["message"]
    assert api.get(f"{ISVCS}/strict") is None


CONFIGMAPS = f"/api/v1/namespaces/{NS}/configmaps"


def apply(api, name: str, data: dict, manager: str, force: bool = False, **meta) -> dict:
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, **meta}, "data": data}
    query = f"?fieldManager={manager}" + ("&force=true" if force else "")
    return api.request("PATCH", f"{CONFIGMAPS}/{name}{query}", body, "application/apply-patch+yaml")


def owned(obj: dict) -> dict[str, dict]:
    """manager/operation -> fieldsV1 of ``obj``'s managedFields."""
    return {f"{e['manager']}/{e['operation']}": e["fieldsV1"] for e in obj["metadata"]["managedFields"]}


def test_apply_records_managed_fields_and_drops_what_the_manager_stops_sending(api):
    created = apply(api, "ssa-drop", {"a": "1", "b": "2"}, "op")
    assert owned(created) == {"op/Apply": {"f:data": {"f:a": {}, "f:b": {}}}}
    again = apply(api, "ssa-drop", {"a": "1"}, "op")
    assert again["data"] == {"a": "1"}
    assert owned(again) == {"op/Apply": {"f:data": {"f:a": {}}}}
    api.delete(f"{CONFIGMAPS}/ssa-drop")


def test_fields_of_another_manager_survive_an_apply(api):
    path = f"{CONFIGMAPS}/ssa-keep"
    apply(api, "ssa-keep", {"a": "1"}, "op")
    api.request(
        "PATCH",
        path + "?fieldManager=kubectl-annotate",
        {"metadata": {"annotations": {"on-call": "alice"}}, "data": {"user": "x"}},
        "application/merge-patch+json",
    )
    live = apply(api, "ssa-keep", {"a": "2"}, "op")
    assert live["data"] == {"a": "2", "user": "x"}
    assert live["metadata"]["annotations"] == {"on-call": "alice"}
    assert owned(live)["kubectl-annotate/Update"] == {
        "f:data": {"f:user": {}},
        "f:metadata": {"f:annotations": {"f:on-call": {}}},
    }
    # A field two managers set stays while either still owns it.
    apply(api, "ssa-keep", {"a": "2", "user": "x"}, "op")
    assert apply(api, "ssa-keep", {"a": "2"}, "op")["data"] == {"a": "2", "user": "x"}
    api.delete(path)


def test_apply_over_another_managers_value_conflicts_unless_forced(api):
    path = f"{CONFIGMAPS}/ssa-conflict"
    apply(api, "ssa-conflict", {"a": "1"}, "op")
    api.request(
        "PATCH", path + "?fieldManager=kubectl-edit", {"data": {"a": "9"}}, "application/merge-patch+json"
    )
    with pytest.raises(urllib.error.HTTPError) as info:
        apply(api, "ssa-conflict", {"a": "1"}, "op")
    assert info.value.code == 409
    body = json.loads(info.value.read())
    assert body["reason"] == "Conflict" and body["details"]["causes"][0]["field"] == "data.a"
    assert 'conflict with "kubectl-edit"' in body["message"]
    assert api.get(path)["data"] == {"a": "9"}
    live = apply(api, "ssa-conflict", {"a": "1"}, "op", force=True)
    assert live["data"] == {"a": "1"}
    assert owned(live) == {"op/Apply": {"f:data": {"f:a": {}}}}  # force moved the field to op
    # The same value is no conflict: both managers own it.
    apply(api, "ssa-conflict", {"a": "1"}, "other")
    assert set(owned(api.get(path))) == {"op/Apply", "other/Apply"}
    api.delete(path)


def deployment(*containers: dict) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "namespace": "ns"},
        "spec": {"template": {"spec": {"containers": list(containers)}}},
    }


def test_an_apply_that_would_drop_another_managers_list_items_is_refused():
    """Where the fake's atomic lists would disagree with a real API server (which merges containers
    and env by name), it refuses rather than answer wrongly."""
    engine = {"name": "engine", "image": "a"}
    ours = deployment(engine)
    live = kmock_fields.apply(None, ours, "op", force=True)
    injected = {**engine, "env": [{"name": "INJECTED", "value": "1"}]}
    for theirs in (deployment(engine, {"name": "mesh-proxy", "image": "p"}), deployment(injected)):
        neighboured = kmock_fields.record_update(live, theirs, "mesh-injector")
        with pytest.raises(kmock_fields.KeyedListNotModelled, match=r"spec\.template\.spec\.containers"):
            kmock_fields.apply(neighboured, ours, "op", force=True)
    # What it does model stays: a hand edit of the operator's container is taken back by a forced apply.
    edited = kmock_fields.record_update(live, deployment({**engine, "image": "b"}), "kubectl-set")
    restored = kmock_fields.apply(edited, ours, "op", force=True)
    assert restored["spec"]["template"]["spec"]["containers"] == [engine]


def test_resource_version_preconditions(api):
    path = f"{CONFIGMAPS}/ssa-version"
    live = apply(api, "ssa-version", {"a": "1"}, "op")
    stale = live["metadata"]["resourceVersion"]
    apply(api, "ssa-version", {"a": "2"}, "op")
    for call in (
        lambda: apply(api, "ssa-version", {"a": "3"}, "op", resourceVersion=stale),
        lambda: api.request(
            "PATCH",
            path,
            [{"op": "replace", "path": "/metadata/resourceVersion", "value": stale}],
            "application/json-patch+json",
        ),
        lambda: api.merge_patch(path, {"metadata": {"resourceVersion": stale}, "data": {"a": "4"}}),
    ):
        with pytest.raises(urllib.error.HTTPError) as info:
            call()
        assert info.value.code == 409
    assert api.get(path)["data"] == {"a": "2"}
    api.delete(path)


def test_apply_without_a_field_manager_is_a_bad_request(api):
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ssa-nobody"}, "data": {}}
    with pytest.raises(urllib.error.HTTPError) as info:
        api.request("PATCH", f"{CONFIGMAPS}/ssa-nobody", body, "application/apply-patch+yaml")
    assert info.value.code == 400


def watch(api, path: str, query: str):
    """The events of a watch of ``path``, one decoded JSON line at a time."""
    response = urllib.request.urlopen(f"{api.url}{path}?watch=true&{query}", timeout=10)
    return response, (json.loads(line) for line in response if line.strip())


def test_a_watch_from_a_compacted_version_gets_410_gone(api):
    live = apply(api, "watched", {"a": "1"}, "op")
    api.expire_watches()
    response, events = watch(api, CONFIGMAPS, f"resourceVersion={live['metadata']['resourceVersion']}")
    with response:
        event = next(events)
        assert event["type"] == "ERROR" and event["object"]["code"] == 410
        assert next(events, None) is None  # the stream ends: the client must list again
    listed = api.get(CONFIGMAPS)["metadata"]["resourceVersion"]
    response, events = watch(api, CONFIGMAPS, f"resourceVersion={listed}&timeoutSeconds=1")
    with response:
        apply(api, "watched", {"a": "2"}, "op")
        # A resumed watch replays nothing the client has seen; the server's timeout ends it.
        assert [(e["type"], e["object"]["data"]) for e in events] == [("MODIFIED", {"a": "2"})]
    api.delete(f"{CONFIGMAPS}/watched")


def test_an_object_leaving_the_selector_arrives_as_deleted(api):
    apply(api, "labelled", {"a": "1"}, "op", labels={"app": "x"})
    response, events = watch(api, CONFIGMAPS, "labelSelector=app%3Dx&timeoutSeconds=2")
    with response:
        assert next(events)["type"] == "ADDED"
        apply(api, "labelled", {"a": "1"}, "op", labels={"app": "y"})
        event = next(events)
        assert (event["type"], event["object"]["metadata"]["labels"]) == ("DELETED", {"app": "y"})
        apply(api, "labelled", {"a": "1"}, "op", labels={"app": "x"})
        assert next(events)["type"] == "ADDED"
    api.delete(f"{CONFIGMAPS}/labelled")


@pytest.fixture
def watch_behaviour(api):
    """Set the server's watch timeout and bookmark interval for one test; both are off again after it."""
    yield api.set_watch_behaviour
    api.set_watch_behaviour()


def test_bookmarks_carry_the_newest_version_and_a_resumed_watch_replays_nothing(api, watch_behaviour):
    watch_behaviour(bookmark_interval_s=0.2)
    apply(api, "marked", {"a": "1"}, "op")
    listed = api.get(CONFIGMAPS)["metadata"]["resourceVersion"]
    query = f"resourceVersion={listed}&allowWatchBookmarks=true&timeoutSeconds=2"
    response, events = watch(api, CONFIGMAPS, query)
    with response:
        # A write this watch does not see (another namespace) still moves its bookmarks on.
        elsewhere = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "far"}, "data": {}}
        far = int(
            api.create("/api/v1/namespaces/elsewhere/configmaps", elsewhere)["metadata"]["resourceVersion"]
        )
        bookmark = next(e for e in events if int(e["object"]["metadata"]["resourceVersion"]) >= far)
        assert bookmark["type"] == "BOOKMARK"
        assert bookmark["object"] == {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"resourceVersion": str(far)},
        }
        changed = apply(api, "marked", {"a": "2"}, "op")
        event = next(e for e in events if e["type"] != "BOOKMARK")
        assert (event["type"], event["object"]["data"]) == ("MODIFIED", {"a": "2"})
        assert int(event["object"]["metadata"]["resourceVersion"]) > far
        rest = list(events)  # until the client's 2 s are up: bookmarks only, at the newest version
    assert rest and {e["type"] for e in rest} == {"BOOKMARK"}
    assert rest[-1]["object"]["metadata"]["resourceVersion"] == changed["metadata"]["resourceVersion"]
    assert api.ended(CONFIGMAPS)[-1] == "timeout"
    # From the last bookmark: nothing the client has seen comes again.
    last = rest[-1]["object"]["metadata"]["resourceVersion"]
    response, events = watch(
        api, CONFIGMAPS, f"resourceVersion={last}&allowWatchBookmarks=true&timeoutSeconds=1"
    )
    with response:
        assert {e["type"] for e in events} == {"BOOKMARK"}
    # A client that does not ask for bookmarks gets none.
    response, events = watch(api, CONFIGMAPS, f"resourceVersion={last}&timeoutSeconds=1")
    with response:
        assert list(events) == []
    api.delete(f"{CONFIGMAPS}/marked")
    api.delete("/api/v1/namespaces/elsewhere/configmaps/far")


def test_the_server_ends_a_watch_on_its_own_timeout_after_a_last_bookmark(api, watch_behaviour):
    watch_behaviour(max_timeout_s=0.5, bookmark_interval_s=60)
    live = apply(api, "timed", {"a": "1"}, "op")
    ended = len(api.ended(CONFIGMAPS))
    # The client asks for 300 s (as kopf does); the server keeps the stream for 0.5 s.
    since = live["metadata"]["resourceVersion"]
    response, events = watch(
        api, CONFIGMAPS, f"resourceVersion={since}&allowWatchBookmarks=true&timeoutSeconds=300"
    )
    with response:
        received = list(events)
    assert api.ended(CONFIGMAPS)[ended:] == ["timeout"]
    assert [e["type"] for e in received] == ["BOOKMARK"]  # the one right before the end, nothing replayed
    assert int(received[0]["object"]["metadata"]["resourceVersion"]) >= int(since)
    api.delete(f"{CONFIGMAPS}/timed")
