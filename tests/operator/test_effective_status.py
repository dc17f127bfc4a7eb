"""Pure pieces: effective configuration, status and conditions, spec parsing helpers."""

from __future__ import annotations

import datetime
from decimal import Decimal

import pytest

from kvpilot.operator.api.settings import resolve
from kvpilot.operator.api.spec import ModelSourceError, parse_duration, parse_model_source, parse_quantity
from kvpilot.operator.reconcile.status import desired_status, merge_conditions, rollout_state, status_patch

NOW = datetime.datetime(2025, 3, 1, 12, 0, 0, tzinfo=datetime.UTC)
LATER = NOW + datetime.timedelta(minutes=5)


def with_overrides(isvc, **overrides):
    isvc["status"] = {"effective": {"overrides": overrides}}
    return isvc


@pytest.mark.parametrize(
    ("overrides", "engine", "replicas", "applied"),
    [
        ({}, {"maxNumSeqs": 128, "gpuMemoryUtilization": 0.9}, 2, ()),
        # An override based on the current spec value applies.
        (
            {"maxNumSeqs": {"value": 64, "specValue": 128}},
            {"maxNumSeqs": 64, "gpuMemoryUtilization": 0.9},
            2,
            ("maxNumSeqs",),
        ),
        # The user has since changed the field (spec 128, override based on 256): the spec wins.
        (
            {"maxNumSeqs": {"value": 64, "specValue": 256}},
            {"maxNumSeqs": 128, "gpuMemoryUtilization": 0.9},
            2,
            (),
        ),
        # A lever the spec leaves unset: the override carries no specValue.
        (
            {"maxNumBatchedTokens": {"value": 4096.0}},
            {"maxNumSeqs": 128, "gpuMemoryUtilization": 0.9, "maxNumBatchedTokens": 4096},
            2,
            ("maxNumBatchedTokens",),
        ),
        (
            {
                "replicas": {"value": 3, "specValue": 2},
                "gpuMemoryUtilization": {"value": 0.93, "specValue": 0.9},
            },
            {"maxNumSeqs": 128, "gpuMemoryUtilization": 0.93},
            3,
            ("gpuMemoryUtilization", "replicas"),
        ),
        # Not a lever: ignored.
        ({"blockSize": {"value": 32}}, {"maxNumSeqs": 128, "gpuMemoryUtilization": 0.9}, 2, ()),
    ],
)
def test_effective_is_spec_plus_current_overrides(make_isvc, overrides, engine, replicas, applied):
    effective = resolve(with_overrides(make_isvc(), **overrides)).effective
    assert (effective.engine, effective.replicas, effective.applied_overrides) == (engine, replicas, applied)
    assert all(isinstance(v, int) for k, v in effective.engine.items() if k == "maxNumBatchedTokens")


def test_reported_effective_fills_engine_defaults(make_isvc):
    reported = resolve(make_isvc(engine={"maxModelLen": 4096})).effective.reported(generation=7)
    assert reported == {
        "gpuMemoryUtilization": 0.9,
        "maxNumSeqs": 256,
        "maxModelLen": 4096,
        "tensorParallelSize": 1,
        "pipelineParallelSize": 1,
        "replicas": 2,
        "basedOnGeneration": 7,
    }


def deployment(generation=1, observed=1, replicas=2, ready=2, available=2, updated=2, progressing=None):
    status = {
        "observedGeneration": observed,
        "replicas": replicas,
        "readyReplicas": ready,
        "availableReplicas": available,
        "updatedReplicas": updated,
    }
    if progressing:
        status["conditions"] = [{"type": "Progressing", "status": progressing[0], "reason": progressing[1]}]
    return {"metadata": {"generation": generation}, "status": status}


@pytest.mark.parametrize(
    ("dep", "desired", "phase", "ready", "progressing"),
    [
        (None, 2, "Pending", "False", "True"),
        (deployment(ready=0, available=0, updated=2), 2, "Pending", "False", "True"),
        (deployment(ready=2, available=2), 2, "Ready", "True", "False"),
        # The Deployment controller has not seen the latest template yet.
        (deployment(generation=2, observed=1), 2, "Progressing", "False", "True"),
        # Mid-rollout with maxSurge 0: one old pod still serving, one new pod loading.
        (deployment(replicas=2, ready=1, available=1, updated=1), 2, "Progressing", "False", "True"),
        # With maxSurge 1: both new pods ready, an old one still running (3 pods for 2 replicas) is
        # not a finished rollout: clients may still reach the old configuration.
        (deployment(replicas=3, ready=3, available=3, updated=2), 2, "Progressing", "False", "True"),
        (
            deployment(ready=1, available=1, progressing=("False", "ProgressDeadlineExceeded")),
            2,
            "Degraded",
            "False",
            "False",
        ),
        (
            deployment(ready=1, available=1, progressing=("True", "NewReplicaSetAvailable")),
            2,
            "Degraded",
            "False",
            "False",
        ),
        (deployment(replicas=0, ready=0, available=0, updated=0), 0, "Stopped", "False", "False"),
        (deployment(replicas=1, ready=0, available=0, updated=0), 0, "Stopped", "False", "True"),
    ],
)
def test_rollout_state(dep, desired, phase, ready, progressing):
    got_phase, conditions = rollout_state(dep, desired)
    assert got_phase == phase
    assert [(c["type"], c["status"]) for c in conditions] == [("Ready", ready), ("Progressing", progressing)]


def test_conditions_keep_transition_times_and_foreign_conditions():
    first = merge_conditions(
        [{"type": "KVCachePressure", "status": "True", "reason": "High", "lastTransitionTime": "x"}],
        [{"type": "Ready", "status": "False", "reason": "RollingOut", "message": "0/2"}],
        1,
        NOW,
    )
    assert [c["type"] for c in first] == ["KVCachePressure", "Ready"]
    same = merge_conditions(
        first, [{"type": "Ready", "status": "False", "reason": "RollingOut", "message": "1/2"}], 1, LATER
    )
    assert same[1]["lastTransitionTime"] == "2025-03-01T12:00:00Z" and same[1]["message"] == "1/2"
    flipped = merge_conditions(
        same, [{"type": "Ready", "status": "True", "reason": "AllReplicasReady", "message": ""}], 2, LATER
    )
    assert (
        flipped[1]["lastTransitionTime"] == "2025-03-01T12:05:00Z" and flipped[1]["observedGeneration"] == 2
    )
    assert flipped[0] == first[0]


def test_status_patch_is_none_when_nothing_owned_changed(make_isvc):
    isvc = make_isvc()
    ready = deployment()
    desired = desired_status(isvc, resolve(isvc).effective, ready, [], "sel", NOW)
    assert status_patch(None, desired) == desired
    isvc["status"] = {
        **desired,
        "signals": {"kvCacheUsage": 0.5},
        "effective": {**desired["effective"], "overrides": {}},
    }
    again = desired_status(isvc, resolve(isvc).effective, ready, [], "sel", LATER)
    assert status_patch(isvc["status"], again) is None
    scaled = desired_status(isvc, resolve(isvc).effective, deployment(ready=1, available=1), [], "sel", LATER)
    patch = status_patch(isvc["status"], scaled)
    assert set(patch) == {"phase", "readyReplicas", "conditions"} and patch["readyReplicas"] == 1
    # A reported key that no longer applies is removed; overrides are never touched.
    isvc["status"]["effective"]["maxModelLen"] = 4096
    assert status_patch(isvc["status"], again) == {"effective": {"maxModelLen": None}}


def test_invalid_spec_status(make_isvc):
    isvc = make_isvc()
    status = desired_status(isvc, None, deployment(), ["spec.image is required"], "sel", NOW)
    conditions = {c["type"]: c for c in status["conditions"]}
    assert status["phase"] == "Failed" and "effective" not in status
    assert (conditions["SpecValid"]["status"], conditions["SpecValid"]["message"]) == (
        "False",
        "spec.image is required",
    )
    assert "last valid configuration keeps serving" in conditions["Ready"]["message"]
    assert status["observedGeneration"] == 3 and status["readyReplicas"] == 2


@pytest.mark.parametrize(
    ("uri", "scheme", "path", "claim", "served"),
    [
        ("pvc://models/llama/8b", "pvc", "llama/8b", "models", "8b"),
        ("pvc://models", "pvc", "", "models", "models"),
        ("hf://meta-llama/Llama-3.1-8B", "hf", "meta-llama/Llama-3.1-8B", None, "meta-llama/Llama-3.1-8B"),
        ("hf://gpt2", "hf", "gpt2", None, "gpt2"),
        ("file:///models/qwen/", "file", "/models/qwen", None, "qwen"),
    ],
)
def test_model_source_parsing(uri, scheme, path, claim, served):
    source = parse_model_source(uri)
    assert (source.scheme, source.path, source.claim, source.default_served_name) == (
        scheme,
        path,
        claim,
        served,
    )


@pytest.mark.parametrize(
    "uri",
    ["s3://b/k", "pvc://Models/x", "pvc://m/../x", "hf://a/b/c", "file://relative", "file:///", "/models"],
)
def test_bad_model_sources(uri):
    with pytest.raises(ModelSourceError):
        parse_model_source(uri)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("64Gi", 64 * 2**30),
        ("500m", Decimal("0.5")),
        ("2", 2),
        ("1e3", 1000),
        ("1.5G", 1_500_000_000),
        (4, 4),
    ],
)
def test_quantities(text, value):
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["64GB", "lots", "", True])
def test_bad_quantities(text):
    with pytest.raises(ValueError):
        parse_quantity(text)


def test_durations():
    assert [parse_duration(d) for d in ("120s", "10m", "1h30m", "500ms")] == [120, 600, 5400, 0.5]
    for bad in ("120", "2 minutes", "", "1d"):
        with pytest.raises(ValueError):
            parse_duration(bad)
